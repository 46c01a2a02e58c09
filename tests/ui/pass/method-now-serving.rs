//! A method named like a clock (`now_serving`) is not a path and is not flagged.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

#[derive(Serialize)]
pub struct Queue {
    pub ticket: u64,
}

impl Queue {
    pub fn now_serving(&self) -> u64 {
        self.ticket
    }
}

#[idempotent(store = idem, key = queue.now_serving(), retain = "1h")]
async fn call_next(idem: &Idem, queue: &Queue) -> Result<u64, IdemError> {
    Ok(queue.ticket)
}

fn main() {}
