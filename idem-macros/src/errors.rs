//! The error collector: every error is reported at once, folded with `Error::combine`
//! (serde's `Ctxt`), and a collector dropped with errors it never handed on panics, so
//! no mistake the checks found can be lost on the way to the user.

use syn::Error;

/// Collects errors so the user sees all of them at once.
#[derive(Default)]
pub(crate) struct Errors {
    errors: Option<Error>,
}

impl Errors {
    pub(crate) fn push(&mut self, error: Error) {
        match &mut self.errors {
            Some(all) => all.combine(error),
            None => self.errors = Some(error),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.errors.is_none()
    }

    /// Hands the errors on: `Err` with all of them, or `Ok` when there were none.
    pub(crate) fn finish(mut self) -> syn::Result<()> {
        match self.errors.take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

impl Drop for Errors {
    fn drop(&mut self) {
        if self.errors.is_some() && !std::thread::panicking() {
            panic!("idem-macros: errors were collected but never reported; call `finish`");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_combined_in_order() {
        let mut errors = Errors::default();
        assert!(errors.is_empty());
        errors.push(Error::new(proc_macro2::Span::call_site(), "first"));
        errors.push(Error::new(proc_macro2::Span::call_site(), "second"));
        let all: Vec<String> = errors
            .finish()
            .unwrap_err()
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert_eq!(all, ["first", "second"]);
    }

    #[test]
    #[should_panic(expected = "never reported")]
    fn dropping_unreported_errors_panics() {
        let mut errors = Errors::default();
        errors.push(Error::new(proc_macro2::Span::call_site(), "lost"));
    }
}
