//! The workload both libraries run in the peer benches (`src/main.rs`, and the
//! criterion bench `benches/in_process.rs`): fingerprint a request (a small one, or a
//! 4 KiB basket of them), claim its key, run a body that returns a small receipt at
//! once, record it.

use std::error::Error;
use std::time::Duration;

use idem_runtime::{Idem, IdemError};
use idempotent::entry::ExistingEntry;
use idempotent::fingerprint::{DefaultFingerprintStrategy, FingerprintStrategy};
use idempotent::store::{IdempotencyStore, InsertResult};
use idempotent::{CachedResponse, IdempotencyEntry, IdempotencyKey, Metadata};
use serde::{Deserialize, Serialize};

/// The benches' error.
pub type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// How long the peer keeps a record.
pub const TTL: Duration = Duration::from_secs(86_400);

/// The request both libraries guard. Its text is static: building a request allocates
/// nothing, and each library's share of a call is what it does with it.
#[derive(Serialize, Clone)]
pub struct Charge {
    pub order: u64,
    pub amount: u64,
    pub currency: &'static str,
    pub customer: &'static str,
}

/// What the body returns and a replay gets back.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Receipt {
    pub id: u64,
    pub amount: u64,
}

/// The request for `order`.
pub fn charge(order: u64) -> Charge {
    Charge {
        order,
        amount: 4200,
        currency: "EUR",
        customer: "cus_8Jk2LmQ9",
    }
}

/// Lines in the 4 KiB request: with its order number, 59 charges are 4 KiB of JSON.
pub const BASKET: usize = 59;

/// The request's size in a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// One charge: 68 bytes of JSON.
    Small,
    /// An order number and [`BASKET`] lines: 4,141 bytes of JSON.
    Large,
}

/// A request of either size for `order`.
#[derive(Serialize, Clone)]
#[serde(untagged)]
pub enum Request {
    /// One charge.
    One(Charge),
    /// An order of many lines.
    Basket(Basket),
}

/// The 4 KiB request: an order number and lines built once, so that it too is built
/// without allocating.
#[derive(Serialize, Clone)]
pub struct Basket {
    pub order: u64,
    pub lines: &'static [Charge],
}

static LINES: std::sync::LazyLock<Vec<Charge>> =
    std::sync::LazyLock::new(|| (0..BASKET as u64).map(charge).collect());

/// The request of `size` for `order`.
pub fn request(size: Size, order: u64) -> Request {
    match size {
        Size::Small => Request::One(charge(order)),
        Size::Large => Request::Basket(Basket {
            order,
            lines: &LINES,
        }),
    }
}

/// The guarded body: returns the receipt at once.
pub fn body(c: &Charge) -> Receipt {
    Receipt {
        id: std::hint::black_box(c.order),
        amount: c.amount,
    }
}

/// The body of a request of either size: its first charge's receipt.
pub fn request_body(r: &Request) -> Receipt {
    match r {
        Request::One(c) => body(c),
        Request::Basket(b) => Receipt {
            id: std::hint::black_box(b.order),
            amount: b.lines.len() as u64,
        },
    }
}

/// One idem call on `key` with a small request: fresh the first time, a replay after.
pub async fn idem_call(idem: &Idem, key: u64) -> Res<()> {
    idem_call_sized(idem, key, Size::Small).await
}

/// One idem call on `key` with a request of `size`.
pub async fn idem_call_sized(idem: &Idem, key: u64, size: Size) -> Res<()> {
    idem_call_of(idem, key, size, true).await
}

/// One idem call on `key` with a request of `size`, fingerprinted or not: without, it
/// is the floor of what the call costs apart from the fingerprint.
pub async fn idem_call_of(idem: &Idem, key: u64, size: Size, fingerprinted: bool) -> Res<()> {
    let c = request(size, key);
    let op = idem.operation("charge", &key).scope("bench");
    let op = if fingerprinted {
        op.fingerprint(&c)
    } else {
        op.fingerprint_none()
    };
    let r = op
        .retain(std::time::Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(request_body(&c)) })
        .await?;
    debug_assert_eq!(r, request_body(&c));
    std::hint::black_box(r);
    Ok(())
}

/// The same call through the peer's store, with a request of `size`.
pub async fn peer_call_sized<S: IdempotencyStore>(store: &S, key: u64, size: Size) -> Res<()> {
    let c = request(size, key);
    let request = serde_json::to_vec(&c)?;
    let fingerprint = DefaultFingerprintStrategy.compute("charge", &request);
    let k = IdempotencyKey::new(format!("bench:charge:{key}"))?;
    let entry = IdempotencyEntry::new(fingerprint, TTL);
    let receipt = match store.try_insert(&k, entry.clone()).await? {
        InsertResult::Claimed { fencing_token } => {
            let receipt = request_body(&c);
            let response = CachedResponse {
                status_code: 200,
                metadata: Metadata::default(),
                body: serde_json::to_vec(&receipt)?.into(),
            };
            store
                .complete(&k, entry.complete(response), fencing_token)
                .await?;
            receipt
        }
        InsertResult::Exists(ExistingEntry::Completed(done)) => {
            if !done.fingerprint_matches(fingerprint) {
                return Err("fingerprint mismatch".into());
            }
            serde_json::from_slice(&done.response().body)?
        }
        InsertResult::Exists(ExistingEntry::Processing(_)) => {
            return Err("in flight".into());
        }
    };
    std::hint::black_box(receipt);
    Ok(())
}

/// The peer's memory store, as both benches build it.
pub fn peer_memory() -> idempotent::store::memory::MemoryStore {
    idempotent::store::memory::MemoryStore::new(1024, Duration::from_secs(3600))
}
