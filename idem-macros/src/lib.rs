//! The `#[idempotent]` attribute: an implementation detail of `idem-runtime`, which
//! re-exports it. Depend on `idem-runtime` instead.

#![warn(missing_docs, unreachable_pub, rust_2018_idioms)]

mod attr;
mod check;
mod expand;

use proc_macro::TokenStream;

/// Makes an `async fn` idempotent.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
