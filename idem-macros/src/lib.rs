//! The `#[idempotent]` attribute, an implementation detail of `idem-runtime`, which
//! re-exports it as `idem_runtime::idempotent`. Depend on
//! `idem-runtime`, not on this crate: the expansion calls into it and the two are
//! released in lockstep.
//!
//! The macro is three phases, one module each: `attr` parses the arguments, `check`
//! validates them (including the random/time key check) and `expand` emits a short
//! call into the runtime's `Operation` builder.

#![warn(missing_docs, unreachable_pub, rust_2018_idioms)]

mod attr;
mod check;
mod errors;
mod expand;
mod scan;

use proc_macro::TokenStream;

/// The `#[idempotent]` attribute. Its documentation, with an example per argument, is
/// `idem_runtime::idempotent`'s: depend on `idem-runtime`, which re-exports it.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
