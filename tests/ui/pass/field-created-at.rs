//! A timestamp carried by the request is a stable value, not a clock read.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

#[derive(Serialize)]
pub struct Event {
    pub source: String,
    pub created_at: u64,
}

#[idempotent(store = idem, key = (event.source, event.created_at), retain = "24h")]
async fn ingest(idem: &Idem, event: &Event) -> Result<u64, IdemError> {
    Ok(event.created_at)
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(idem: &Idem, event: &Event) {
    assert_send(ingest(idem, event));
}

fn main() {}
