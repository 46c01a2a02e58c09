//! Patterned parameters contribute the names they bind to the key and fingerprint.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

/// An extractor-style wrapper, as agent tool frameworks use.
pub struct Parameters<T>(pub T);

#[derive(Serialize)]
pub struct TransferArgs {
    pub idempotency_key: String,
    pub cents: u64,
}

#[idempotent(store = idem, key = args.idempotency_key, retain = "1d")]
async fn transfer(
    idem: &Idem,
    Parameters(args): Parameters<TransferArgs>,
) -> Result<u64, IdemError> {
    Ok(args.cents)
}

#[idempotent(store = idem, key = (from, to), retain = "1d")]
async fn link(
    idem: &Idem,
    (from, to): (u64, u64),
    Point { x, y: _ }: Point,
) -> Result<u64, IdemError> {
    Ok(from + to + x)
}

pub struct Point {
    pub x: u64,
    pub y: u64,
}

fn main() {}
