//! `crate = path` and `crate = "path"`, for crates that re-export idem-runtime.
#![deny(warnings)]
#![allow(dead_code)]

mod reexport {
    pub use idem_runtime as idem;
}

use idem_runtime::{Idem, IdemError, idempotent};

#[idempotent(crate = idem_runtime, store = idem, key = id, retain = "1d")]
async fn plain(idem: &Idem, id: u64) -> Result<(), IdemError> {
    Ok(())
}

#[idempotent(crate = "self::reexport::idem", store = idem, key = id, retain = "1d")]
async fn quoted(idem: &Idem, id: u64) -> Result<(), IdemError> {
    Ok(())
}

#[idempotent(crate = reexport::idem, store = idem, key = id, retain = "1d")]
async fn relative(idem: &Idem, id: u64) -> Result<(), IdemError> {
    Ok(())
}

fn main() {}
