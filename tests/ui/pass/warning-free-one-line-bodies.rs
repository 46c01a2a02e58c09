//! The expansion adds no warning of its own, whatever the body: one-line bodies (where a
//! `{ Ok(x) }` tail would draw `unused_braces`), methods, generics, `fingerprint = none`,
//! a body that ignores its `tx`, recorded and classified errors.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Disposition, Idem, IdemError, KeyPart, idempotent};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};

#[idempotent(store = idem, key = id, retain = "1h")]
async fn one_line(idem: &Idem, id: u64) -> Result<u64, IdemError> { Ok(id) }

#[idempotent(store = idem, key = id, retain = "1h", fingerprint = none)]
async fn unbound(idem: &Idem, id: u64, note: &str) -> Result<usize, IdemError> { Ok(note.len()) }

#[idempotent(store = idem, key = id, retain = "1h")]
async fn all_skipped(idem: &Idem, #[idem(skip)] id: u64) -> Result<u64, IdemError> { Ok(id) }

#[idempotent(store = idem, key = id, retain = "1h")]
async fn unit(idem: &Idem, id: u64) -> Result<(), IdemError> { Ok(()) }

#[idempotent(store = idem, key = id, retain = "1h")]
async fn question_mark(idem: &Idem, id: &str) -> Result<u64, IdemError> { Ok(parse(id)? + 1) }

fn parse(id: &str) -> Result<u64, IdemError> { id.parse().map_err(|_| IdemError::NoStore) }

#[idempotent(store = store, key = id, retain = "1h")]
async fn generic<S, K, T>(store: &S, id: &K, value: T) -> Result<T, IdemError>
where
    S: AsRef<Idem> + Sync + ?Sized,
    K: KeyPart + Serialize + Sync + ?Sized,
    T: Serialize + DeserializeOwned + Send,
{ Ok(value) }

#[idempotent(store = idem, key = id, retain = "1h")]
async fn generic_inline<T: Serialize + DeserializeOwned + Clone + Send + Sync>(idem: &Idem, id: u64, value: &T) -> Result<T, IdemError> { Ok(value.clone()) }

pub struct Payments {
    idem: Idem,
    fee: u64,
}

impl Payments {
    #[idempotent(store = self.idem, key = id, retain = "1h")]
    pub async fn charge(&self, id: u64) -> Result<u64, IdemError> { Ok(id + self.fee) }

    #[idempotent(store = self.idem, key = id, retain = "1h", fingerprint = none)]
    pub async fn reset(&mut self, id: u64) -> Result<u64, IdemError> { Ok(id) }

    #[idempotent(store = self.idem, key = (self.fee, id), retain = "1h", fingerprint = none)]
    pub async fn quote(&self, id: u64) -> Result<u64, IdemError> { Ok(self.fee) }
}

#[derive(Debug, Serialize, Deserialize)]
pub enum PayError {
    Declined,
    #[serde(skip)]
    Idem(IdemError),
}

impl From<IdemError> for PayError {
    fn from(e: IdemError) -> Self { PayError::Idem(e) }
}

fn classify(e: &PayError) -> Disposition { match e { PayError::Declined => Disposition::Record, PayError::Idem(_) => Disposition::Release } }

#[idempotent(store = idem, key = id, retain = "1h", errors = record)]
async fn recorded(idem: &Idem, id: u64) -> Result<u64, PayError> { Err(PayError::Declined) }

#[idempotent(store = idem, key = id, retain = "1h", classify = classify)]
async fn classified(idem: &Idem, id: u64) -> Result<u64, PayError> { Ok(id) }

#[idempotent(store = idem, tx = tx, key = id, retain = "1h")]
async fn tx_ignored(idem: &Idem, tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<u64, IdemError> { Ok(id) }

#[idempotent(store = idem, tx = tx, key = id, retain = "1h", lease = "2s", fingerprint = none)]
async fn tx_with_lease(idem: &Idem, tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<u64, IdemError> { Ok(id) }

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(idem: &Idem, payments: &Payments, tx: &mut Transaction<'_, Sqlite>) {
    assert_send(one_line(idem, 1));
    assert_send(generic(idem, "k", 1u32));
    assert_send(payments.charge(1));
    assert_send(tx_with_lease(idem, tx, 1));
}

fn main() {}
