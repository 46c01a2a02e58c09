//! Defaulted operation names. An `#[idempotent]` function without `name = "..."` is
//! named after itself, so two functions of one name (`stripe::refund` and
//! `paypal::refund`) would share records, and the second would be answered with the
//! first's outcome without running. Each such function registers its site at link time
//! (with `inventory`); on a site's first call the registry is searched once for another
//! site of the same name, and the verdict is kept in the site, so every later call
//! costs one atomic load. Every site of a shared name sees the others, so each of them
//! refuses, whichever is called first.

use std::sync::OnceLock;

use crate::error::IdemError;
use crate::idem::Idem;
use crate::key::KeyPart;
use crate::op::{NewOperation, Operation};

/// Not a stable API: how an expansion names its operation: the string of an explicit
/// `name = "..."`, or the function's [`DefaultedName`] site.
pub trait OpName {
    /// Not a stable API: a new operation of this name.
    fn operation<K: KeyPart + ?Sized>(&self, idem: Option<Idem>, key: &K) -> NewOperation;
}

/// An explicit name, which functions may share on purpose.
impl OpName for str {
    fn operation<K: KeyPart + ?Sized>(&self, idem: Option<Idem>, key: &K) -> NewOperation {
        Operation::new(idem, self, key)
    }
}

/// A defaulted name: refused when another function defaults to it too.
impl OpName for DefaultedName {
    fn operation<K: KeyPart + ?Sized>(&self, idem: Option<Idem>, key: &K) -> NewOperation {
        let mut op = Operation::new(idem, self.name, key);
        if let Err(clash) = self.check() {
            // Ahead of whatever else the builder found: this call must not run at all.
            op.invalid = Some(Box::new(clash));
        }
        op
    }
}

/// Not a stable API: one `#[idempotent]` function whose operation name is defaulted
/// from its own name; a `static` in the function's expansion.
pub struct DefaultedName {
    name: &'static str,
    module: &'static str,
    file: &'static str,
    line: u32,
    /// `None` while the name is this function's alone; else the refusal's message.
    verdict: OnceLock<Option<Box<str>>>,
}

/// Not a stable API: a site as the registry holds it.
pub struct Registered(pub &'static DefaultedName);

inventory::collect!(Registered);

impl DefaultedName {
    /// Not a stable API: the site of the function `name` in `module`, at `file:line`.
    pub const fn new(
        name: &'static str,
        module: &'static str,
        file: &'static str,
        line: u32,
    ) -> DefaultedName {
        DefaultedName {
            name,
            module,
            file,
            line,
            verdict: OnceLock::new(),
        }
    }

    /// `Config` when another function in this process defaults to the same name.
    fn check(&self) -> Result<(), IdemError> {
        match self.verdict.get_or_init(|| self.clash()) {
            None => Ok(()),
            Some(message) => Err(IdemError::Config {
                message: message.to_string(),
            }),
        }
    }

    fn clash(&self) -> Option<Box<str>> {
        let mut sites: Vec<&DefaultedName> = inventory::iter::<Registered>
            .into_iter()
            .map(|r| r.0)
            .filter(|site| site.name == self.name)
            .collect();
        // Listed even where the linker left this site out of the registry.
        sites.push(self);
        // The same message from every site of the name, in a stable order.
        sites.sort_by_key(|site| (site.module, site.file, site.line));
        sites.dedup_by(|a, b| std::ptr::eq(*a, *b));
        if sites.len() < 2 {
            return None;
        }
        let mut listed: Vec<String> = sites
            .iter()
            .map(|site| {
                format!(
                    "`{}::{}` ({}:{})",
                    site.module, site.name, site.file, site.line
                )
            })
            .collect();
        let last = listed.pop().unwrap_or_default();
        let (listed, all) = (
            listed.join(", "),
            if sites.len() > 2 { "all" } else { "both" },
        );
        let name = self.name;
        Some(
            format!(
                "the `#[idempotent]` functions {listed} and {last} {all} default to the \
                 operation name `{name}`, so they would share records and one would be \
                 answered with another's outcome without running; give each its own \
                 `name = \"...\"` (the one whose records should stay keeps \
                 `name = \"{name}\"`), or, if they are one operation on purpose, the same \
                 explicit `name`"
            )
            .into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static ALONE: DefaultedName = DefaultedName::new("names_test_alone", "a", "a.rs", 1);
    inventory::submit! { Registered(&ALONE) }

    static FIRST: DefaultedName = DefaultedName::new("names_test_shared", "b", "b.rs", 2);
    inventory::submit! { Registered(&FIRST) }
    static SECOND: DefaultedName = DefaultedName::new("names_test_shared", "c", "c.rs", 3);
    inventory::submit! { Registered(&SECOND) }

    #[test]
    fn a_name_of_one_site_passes_and_a_shared_one_is_refused_at_both() {
        assert!(ALONE.check().is_ok());
        let second = SECOND.check().unwrap_err().to_string();
        let first = FIRST.check().unwrap_err().to_string();
        assert_eq!(first, second, "both sites give the same message");
        assert!(
            first.contains("`b::names_test_shared` (b.rs:2) and `c::names_test_shared` (c.rs:3)"),
            "{first}"
        );
        // The verdict is kept: a later call answers alike.
        assert_eq!(FIRST.check().unwrap_err().to_string(), first);
    }
}
