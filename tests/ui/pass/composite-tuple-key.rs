//! A tuple is a composite key; its owned fields are borrowed, not moved out.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::Serialize;

#[derive(Serialize)]
pub struct Message {
    pub source: String,
    pub id: String,
    pub attempt: u32,
}

#[idempotent(store = idem, key = (msg.source, msg.id, "v1"), retain = "3d")]
async fn consume(idem: &Idem, msg: &Message) -> Result<String, IdemError> {
    Ok(format!("{}:{}", msg.source, msg.id))
}

// Owned parameters: the key borrows them, the body still gets them by value.
#[idempotent(store = idem, key = (source, id), retain = "3d")]
async fn consume_owned(idem: Idem, source: String, id: String) -> Result<String, IdemError> {
    drop(idem);
    Ok(source + &id)
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(idem: &Idem, msg: &Message) {
    assert_send(consume(idem, msg));
    assert_send(consume_owned(idem.clone(), String::new(), String::new()));
}

fn main() {}
