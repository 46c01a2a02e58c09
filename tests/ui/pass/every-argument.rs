//! Every argument at once (`errors` and `tx` aside: they exclude `classify`, and
//! `in_flight`, `on_takeover` and `fail_open`).
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Disposition, Idem, IdemError, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Receipt {
    pub cents: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PayError {
    Declined,
    Timeout,
    Idem(String),
}

impl From<IdemError> for PayError {
    fn from(e: IdemError) -> Self {
        PayError::Idem(e.to_string())
    }
}

fn classify(e: &PayError) -> Disposition {
    match e {
        PayError::Declined => Disposition::Record,
        PayError::Timeout => Disposition::Unknown,
        PayError::Idem(_) => Disposition::Release,
    }
}

fn upgrade(_from: u32, old: serde_json::Value) -> Result<Receipt, IdemError> {
    let _ = old;
    Ok(Receipt { cents: 0 })
}

#[idempotent(
    key = order_id,
    scope = tenant,
    retain = "1h 30m",
    store = idem,
    name = "payments.charge",
    lease = "90s",
    in_flight = wait("2s 500ms"),
    classify = classify,
    on_takeover = unknown,
    fingerprint = (order_id, cents),
    on_store_error = fail_open,
    version = 3,
    upgrade = upgrade,
    crate = idem_runtime,
)]
async fn charge(idem: &Idem, tenant: &str, order_id: u64, cents: u64) -> Result<Receipt, PayError> {
    Ok(Receipt { cents })
}

#[idempotent(
    store = idem,
    key = order_id,
    retain = "10m",
    errors = record,
    in_flight = reject,
    on_takeover = rerun,
    on_store_error = fail_closed,
    fingerprint = none,
)]
async fn decline(idem: &Idem, order_id: u64) -> Result<Receipt, PayError> {
    Err(PayError::Declined)
}

#[idempotent(store = idem, key = order_id, retain = "10m", errors = release)]
async fn retry(idem: &Idem, order_id: u64) -> Result<Receipt, PayError> {
    Err(PayError::Timeout)
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(idem: &Idem) {
    assert_send(charge(idem, "acme", 1, 100));
    assert_send(decline(idem, 1));
}

fn main() {}
