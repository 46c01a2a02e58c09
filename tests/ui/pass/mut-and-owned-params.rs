//! `mut` and owned parameters move into the body as they did in the original fn.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

#[derive(Serialize, Clone)]
pub struct Cart {
    pub id: String,
    pub items: Vec<String>,
}

#[idempotent(store = idem, key = cart.id, retain = "1d")]
async fn checkout(idem: Idem, mut cart: Cart, mut attempts: u32) -> Result<Vec<String>, IdemError> {
    attempts += 1;
    cart.items.push(format!("attempt {attempts}"));
    let _still_ours = idem;
    Ok(cart.items)
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(idem: &Idem, cart: &Cart) {
    assert_send(checkout(idem.clone(), cart.clone(), 0));
}

fn main() {}
