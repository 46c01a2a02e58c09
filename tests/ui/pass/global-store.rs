//! Without `store`, the operation runs on the store set with `Idem::set_global`.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{IdemError, idempotent};

#[idempotent(key = (user_id, template), retain = "1d")]
pub async fn send_email(user_id: u64, template: &str) -> Result<(), IdemError> {
    Ok(())
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send() {
    assert_send(send_email(1, "welcome"));
}

fn main() {}
