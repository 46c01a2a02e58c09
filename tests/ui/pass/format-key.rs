//! `format!` keys, with positional arguments and inline captures of parameters.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

#[derive(Serialize)]
pub struct Order {
    pub id: u64,
}

#[idempotent(store = idem, key = format!("charge:v1:{}", order.id), retain = "7d")]
async fn charge(idem: &Idem, order: &Order) -> Result<u64, IdemError> {
    Ok(order.id)
}

#[idempotent(store = idem, key = format!("refund:{order_id}:{reason:?}"), retain = "7d")]
async fn refund(idem: &Idem, order_id: u64, reason: &str) -> Result<u64, IdemError> {
    Ok(order_id)
}

fn main() {}
