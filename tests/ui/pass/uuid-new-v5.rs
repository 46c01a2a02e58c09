//! `Uuid::new_v5` is derived from its inputs, so it is a stable key.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;
use uuid::Uuid;

#[derive(Serialize)]
pub struct Order {
    pub number: String,
}

#[idempotent(
    store = idem,
    key = Uuid::new_v5(&Uuid::NAMESPACE_OID, order.number.as_bytes()),
    retain = "7d"
)]
async fn ship(idem: &Idem, order: &Order) -> Result<(), IdemError> {
    Ok(())
}

fn main() {}
