//! A user function whose name mentions a clock is not a clock read.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

#[derive(Serialize)]
pub struct Shift {
    pub worker: u32,
    pub day: u32,
}

fn clock_id(shift: &Shift) -> String {
    format!("{}-{}", shift.worker, shift.day)
}

#[idempotent(store = idem, key = clock_id(shift), retain = "30d")]
async fn clock_in(idem: &Idem, shift: &Shift) -> Result<(), IdemError> {
    Ok(())
}

fn main() {}
