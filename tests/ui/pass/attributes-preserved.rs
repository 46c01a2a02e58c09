//! Other attributes, doc comments, `unsafe` and `r#` names are kept.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};

/// Sends the invoice.
#[must_use = "the invoice is sent only when awaited"]
#[idempotent(store = idem, key = invoice, retain = "7d")]
#[allow(clippy::needless_lifetimes)]
pub(crate) async fn send_invoice<'a>(idem: &'a Idem, invoice: &'a str) -> Result<usize, IdemError> {
    Ok(invoice.len())
}

#[idempotent(store = idem, key = id, retain = "7d", name = "type")]
async fn r#type(idem: &Idem, id: u64) -> Result<u64, IdemError> {
    Ok(id)
}

fn main() {}
