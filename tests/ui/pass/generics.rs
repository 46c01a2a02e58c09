//! Generic functions with where-clauses and a generic store.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, KeyPart, idempotent};
use serde::Serialize;
use serde::de::DeserializeOwned;

#[idempotent(store = store, key = id, retain = "1h")]
async fn publish<S, K, T>(store: &S, id: &K, payload: T) -> Result<T, IdemError>
where
    S: AsRef<Idem> + Sync + ?Sized,
    K: KeyPart + Serialize + Sync + ?Sized,
    T: Serialize + DeserializeOwned + Send,
{
    Ok(payload)
}

#[idempotent(store = idem, key = key, retain = "1h")]
async fn echo<'a, T: Serialize + DeserializeOwned + Clone + Send + Sync>(
    idem: &'a Idem,
    key: &'a str,
    value: &'a T,
) -> Result<T, IdemError> {
    Ok(value.clone())
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(idem: &Idem) {
    assert_send(publish(idem, "k", 1u32));
    assert_send(echo(idem, "k", &1u32));
}

fn main() {}
