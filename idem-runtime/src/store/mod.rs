//! The storage contract behind [`Idem`](crate::Idem), and its implementations.
//!
//! ```
//! use idem_runtime::{Idem, IdemError};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! let in_process = Idem::memory(); // tests and single-process tools; gone on exit
//! # #[cfg(feature = "sqlite")]
//! let embedded = Idem::sqlite("sqlite::memory:").await?; // a file on one host
//! // Idem::postgres, Idem::mysql and Idem::redis open the server stores.
//! let stats = in_process.stats().await?;
//! assert_eq!(stats.in_progress + stats.completed + stats.unknown, 0);
//! # Ok(()) }
//! ```
//!
//! A store keeps one record per operation `(scope, name, key)` and moves it through
//! the states of the contract. Every method that changes a record is one atomic step;
//! every method after a claim is fenced on the epoch that claimed. [`Store`] is that
//! contract as the state machine calls it, each answer a [`StoreFuture`] (ready at once
//! from a store in this process); its supertrait [`Admin`] is the operator's side
//! (list, get, resolve, forget, purge, stats). [`Idem`](crate::Idem) opens one of these:
//!
//! | store | durability | many hosts, cluster | [transactional mode](crate::guide::transactions) | cross-process wake-ups |
//! |---|---|---|---|---|
//! | [`Idem::memory`](crate::Idem::memory) | the process's life | no | no | (one process) |
//! | `Idem::sqlite` ([`guide::sqlite`](crate::guide::sqlite)) | WAL, `synchronous=FULL`: survives power loss | one host, several processes | yes | no: waiters poll |
//! | `Idem::postgres` ([`guide::postgres`](crate::guide::postgres)) | the server's commit | yes | yes | `LISTEN`/`NOTIFY` |
//! | `Idem::mysql` ([`guide::mysql`](crate::guide::mysql)) | InnoDB's commit | yes | yes | no: waiters poll |
//! | `Idem::redis` ([`redis`]) | the server's persistence settings | yes, Redis Cluster | no | pub/sub |
//!
//! [`Idem::connect`](crate::Idem::connect) opens any of them from one URL, chosen by its
//! scheme (`sqlite:`, `postgres:`, `mysql:`, `redis:`, `redis+cluster:`, `memory:`).
//!
//! Each store proves itself against one conformance suite, and a store of your own can
//! be passed to [`IdemBuilder::store`](crate::IdemBuilder::store); a wrapper around an
//! opened store (metrics, fault injection) to [`IdemBuilder::layer`](crate::IdemBuilder::layer).
//!
//! # Network faults
//!
//! No call waits on a store without a bound, whichever store it is:
//!
//! | round trip | bounded by | what the caller gets past it |
//! |---|---|---|
//! | the claim, the read that looks for a replay | [`IdemBuilder::store_timeout`](crate::IdemBuilder::store_timeout), 5 s by default | [`IdemError::Store`](crate::IdemError::Store), retryable; the body did not run (and `fail_open` does not run it: silence may be a lock wait) |
//! | the record, with its retries | what is left of the lease, as a whole; one attempt, the store timeout and half a lease | [`IdemError::Unrecorded`](crate::IdemError::Unrecorded): the body ran; its record may or may not have landed |
//! | a release | the store timeout (and the lease) | the claim lapses with its lease |
//! | a move to UNKNOWN, with its retries | the lease as it stood when the move began; one attempt, the store timeout | the claim lapses with its lease |
//! | a lease renewal | the store timeout and a third of the lease | the next renewal is tried |
//!
//! So during a partition a call answers within the store timeout if its body had not
//! started, and within about one lease if it had. Retry a `Store` error with the same
//! key once the store is back. After `Unrecorded`, the claim stays in progress until its
//! lease lapses; a retry with the same key then replays the outcome if its record
//! landed, or runs the body again (`on_takeover = rerun`) or answers `Unknown`
//! (`on_takeover = unknown`), so give the downstream system
//! [`downstream_key`](crate::Current::downstream_key) where a second run must not
//! repeat the effect. A statement that timed out has its connection closed at once
//! rather than reused or waited on, so a connection gone silent frees its place for a
//! new one. A claim that timed out may still have been made by the store: nobody knows
//! its epoch, so it lapses with its lease. A call that goes away before its body starts
//! has its claim released, if the store answers within the store timeout of the
//! claim's sending.
//!
//! # A new SQL backend
//!
//! A SQL backend is one folder, `store/<db>/`, with its statements in `sql/<db>/` and
//! its DDL in `migrations/<db>/`. The engine (`SqlStore` over a `Dialect`, in
//! `store/engine/`) does the rest: claims, replays, records, fencing, renewals, purge,
//! listing, migrations and transactional mode. A new one touches:
//!
//! 1. `sql/<db>/`: one file per statement, named as in the table of
//!    `store/engine/statements.rs` (`statement_table!`): every `Sql` (the `tx_*` ones
//!    for transactional mode among them) and the `OptionalSql` it has (`peek`,
//!    `claim_fresh`, `wake`, ...). They are written with named parameters (`:scope`,
//!    `:epoch`, ...) and the engine's names (`{table}`, `{steps}`, `{now}`, `{lapsed}`,
//!    `{expired}`, `{released}`, `{next_epoch}`); the fragments `lapsed`, `expired` and
//!    `released` are files too, and `record_step` and `steps` keep an operation's
//!    [steps](crate::step) (the operations table's `steps` column says whether its
//!    current life has any). A missing file, or a misspelt name, does not compile.
//! 2. `migrations/<db>/`: the DDL in order.
//! 3. `store/<db>/mod.rs`: a dialect (a `pub` struct holding the pool) implementing
//!    `Dialect`, whose statements one call makes: `dialect_sql!("<db>", <the
//!    OptionalSql it has>)`. Required: `Db`, `Conn`, `NOW`, `NEXT_EPOCH`, `SCHEMA`,
//!    `placeholder`, `map_err`, `fetch`, `begin_migrations`, `run_script`, `execute`,
//!    `from_pool`. Defaulted, overridden where the database differs:
//!    `CLAIM_ATTEMPTS` and `is_conflict` (a claim a concurrent commit can void),
//!    `is_lock_wait` (the purge), `NUMBERED_PLACEHOLDERS`, `PEEK_WHILE_REPLAYING`,
//!    `PEEK_ON_HOT`, `CLAIM_TOKEN`, `attach_wakers` (wake-ups from other processes),
//!    `gathers` and `gathered` (group commit), and for transactional mode
//!    `transaction_gone` (whether the server rolled the caller's transaction back on its
//!    own; transactional mode runs its savepoints through `run_script`). Then
//!    `impl SqlDb for sqlx::<Db> { type Dialect = <the dialect>; }`: with it the
//!    database's `sqlx::Transaction` is a [`TxConnection`](crate::TxConnection) and its
//!    `sqlx::Pool` an [`IntoStore`](crate::IntoStore), with nothing else to write. Beside
//!    them its `MIGRATIONS`, published as `pub const <DB>_SCHEMA_SQL`, and
//!    `open(url, &SqlOptions)`.
//! 4. `store/<db>/open.rs`: `Idem::<db>` and `IdemBuilder::<db>`, in `impl Idem` and
//!    `impl IdemBuilder` blocks of its own, which call its `open` with the builder's
//!    `sql_options()` and hand the store to `sql_store`.
//! 5. Outside its folders, a line or a few in each of four places:
//!    - `Cargo.toml`: its feature, enabling `_sql` (`_sql_server` for a server reached
//!      by URL, which brings `store/server.rs`), `_sql_group` if it gathers writes with
//!      `store/group.rs`, and the sqlx driver;
//!    - this file: its `mod <db>;` line, and its `<DB>_SCHEMA_SQL` in `schemas` (which
//!      `idem_runtime::schema` re-exports). The `mod` line is written out, not made by a
//!      macro from a table, because `cargo fmt` and other tools find a module's file
//!      only through a written `mod` item;
//!    - `connect.rs`, its scheme entry: its URL schemes, the `Target` they parse to, the
//!      builder method that opens it, and its feature's name for the refusal when off;
//!    - `store/engine/mod.rs`, its variant of `SqlHandle` (named through sqlx's type),
//!      which its dialect's `handle` and `handled` fill and read: how transactional
//!      mode finds the store, typed, for the caller's connection.
//!
//!    Its page in `guide/` is the docs' part.
//!
//! What proves it: `conformance::run_all` on the store its `IdemBuilder::<db>` opens
//! (`tests/suite/conformance.rs` takes it through the builder's `layer` hook), and
//! `conformance::tx::run_all` on a `TxTarget` of its pool, an `Idem::from_pool` on that
//! pool and a business table (`tests/suite/transactional.rs`, after a `tx_database!`
//! line for the database in `store/conformance/tx/database.rs`, whose checks write that
//! table with statements of their own). Its own unit tests call
//! `engine::render_all::<Dialect>` to render every statement it has.

#[doc(hidden)]
pub mod conformance;
mod delegate;
mod future;
mod memory;
pub(crate) mod packed;
mod record;
#[cfg(test)]
#[allow(dead_code, reason = "each store's tests take what they need")]
mod test_support;
pub(crate) mod wake;
pub use delegate::Delegate;
pub use future::StoreFuture;
pub use memory::MemoryStore;
pub use wake::WakeHub;
#[cfg(any(feature = "_sql", feature = "redis"))]
mod gate;
#[cfg(any(feature = "_sql", feature = "redis"))]
pub(crate) use gate::ReplayGate;
#[cfg(feature = "_sql_server")]
#[doc(hidden)]
pub mod bench;
#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub mod dynamodb;
#[cfg(feature = "_sql")]
pub(crate) mod engine;
#[cfg(feature = "_sql_group")]
mod group;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "_sql_server")]
mod server;
mod types;

// The SQL backends, a folder each.
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// The DDL each SQL backend ships, which [`crate::schema`] re-exports.
#[cfg(feature = "_sql")]
pub(crate) mod schemas {
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub use super::mysql::MYSQL_SCHEMA_SQL;
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub use super::postgres::POSTGRES_SCHEMA_SQL;
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub use super::sqlite::SQLITE_SCHEMA_SQL;
}

use std::time::Duration;

pub use crate::error::StoreError;
pub use types::{
    Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RESUME_WINDOW, RecordDetail,
    RecordInfo, Resolution, State, Stats, StepRecord, StoredOutcome, Takeover,
};
pub(crate) use types::{OutcomeRef, sort_listed};

/// The lease a store with a millisecond clock writes for `lease`: whole milliseconds,
/// rounded up, and one more. Such a clock reads a moment rounded down, so an end written
/// as `now + lease` could fall up to a millisecond before a full lease from the write;
/// with the extra millisecond a lease never lapses before its caller's count of it (when
/// it sent the write, plus the lease).
#[cfg(any(feature = "_sql", feature = "redis"))]
pub(crate) fn lease_written(lease: Duration) -> Duration {
    let ms = lease.as_nanos().div_ceil(1_000_000).saturating_add(1);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// The durable half of idem: the calls the state machine makes on every operation.
///
/// Implementations decide the claim in one atomic step: an insert-or-inspect that
/// returns the state it found or made. Times (leases, expiry, ages) are the store's
/// own clock, never the application's. The state machine talks to a store through this
/// trait only; [`Idem`](crate::Idem) is what applications call. The operator's side
/// (listing, reconciling, purging) is the supertrait [`Admin`].
///
/// Each method returns a [`StoreFuture`]: [`StoreFuture::ready`] from a store that
/// answers in this process, so the call allocates nothing; [`StoreFuture::new`] over an
/// `async` block from one that makes a round trip. The state machine may drop a future
/// it has not polled, so the work belongs inside the future.
///
/// ```
/// use idem_runtime::store::{Claim, ClaimRequest, MemoryStore, Store, StoreError, StoredOutcome};
/// use idem_runtime::{OperationId, Takeover};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), StoreError> {
/// let store = MemoryStore::default();
/// let id = OperationId { scope: String::new(), name: "charge".into(), key: "order-1".into() };
/// let lease = Duration::from_secs(60);
/// let req = ClaimRequest { id: &id, fingerprint: [1; 32], lease, on_takeover: Takeover::Rerun };
///
/// let Claim::Acquired { epoch, .. } = store.claim(&req).await? else { unreachable!() };
/// // A duplicate while the first call runs:
/// assert!(matches!(store.claim(&req).await?, Claim::InFlight { .. }));
/// let outcome = StoredOutcome::new(b"42".to_vec(), false, 1);
/// store.record(&id, epoch, &outcome, Duration::from_secs(3600)).await?;
/// // A duplicate after it, and the same key with another request:
/// assert_eq!(store.claim(&req).await?, Claim::Completed(outcome));
/// let other = ClaimRequest { fingerprint: [2; 32], ..req.clone() };
/// assert_eq!(store.claim(&other).await?, Claim::Mismatch);
/// # Ok(()) }
/// ```
pub trait Store: Admin {
    /// Claims the operation, or reports why not. One atomic step.
    fn claim<'a>(&'a self, req: &'a ClaimRequest<'a>)
    -> StoreFuture<'a, Result<Claim, StoreError>>;

    /// Reads a COMPLETED, unexpired outcome without writing, for the replay fast path.
    /// `None` means "not known to be completed": the caller then claims. A store whose
    /// claim answers a replay as cheaply as a read answers `None` at once (the default).
    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        let _ = (id, fingerprint);
        StoreFuture::ready(Ok(None))
    }

    /// Records the outcome of `epoch`, keeping it for `retain`.
    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>>;

    /// Releases the claim of `epoch`: the record goes away and a retry runs the body.
    /// An operation with recorded [steps](Store::record_step) keeps its record, its
    /// fingerprint and its steps instead, with no lease, for `retain` from now (the
    /// operation's retention): until then the next claim with the same fingerprint
    /// acquires it at once (whatever `on_takeover` says) with `resume` set, and another
    /// fingerprint is a [`Claim::Mismatch`]. From then on it is expired, as a completed
    /// record past its retention is: [`purge_expired`](Admin::purge_expired) deletes it
    /// with its steps, and a claim with any fingerprint starts it afresh, without them.
    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>>;

    /// Moves the claim of `epoch` to UNKNOWN.
    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>>;

    /// Extends the lease of `epoch` to `lease` from now: to no earlier than the moment
    /// the call was made plus `lease`, which is what the caller counts on (a clock of
    /// whole milliseconds rounds the end up; `conformance` checks it, as it does a
    /// claim's lease).
    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>>;

    /// Records the `Ok` outcome of step `label` of the operation, under the claim of
    /// `epoch`: one atomic step, fenced like [`record`](Store::record), so
    /// [`Fence::Lost`] unless the record is IN_PROGRESS at `epoch`. Recording a label
    /// again replaces its outcome (a retry whose reply was lost writes the same one).
    /// Steps belong to one life of the record: the first step recorded after a claim
    /// that did not `resume` discards any steps left from an earlier life (a record that
    /// completed, expired and was claimed afresh). Steps expire and are purged, released,
    /// resolved and forgotten with their operation. The default says the store keeps no
    /// steps.
    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        let _ = (id, epoch, label, outcome);
        StoreFuture::ready(Err(no_steps()))
    }

    /// The steps recorded in the operation's current life, oldest first; none for an
    /// operation that has no record or has not recorded a step since it was claimed
    /// afresh. The default finds none, as a store that cannot record them has none.
    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        let _ = id;
        StoreFuture::ready(Ok(Vec::new()))
    }

    /// Called once by a caller about to wait on an in-flight operation, so a store
    /// that can wake waiters in other processes knows to do so. The default does nothing
    /// (waiters then fall back to polling).
    fn announce_wait<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<(), StoreError>> {
        let _ = id;
        StoreFuture::ready(Ok(()))
    }

    /// Gives the store the hub through which it wakes waiters of this process when it
    /// learns (from another process) that an operation moved on.
    fn attach_wakers(&self, hub: std::sync::Arc<WakeHub>) {
        let _ = hub;
    }

    /// Asks the store to read before every claim from now on
    /// ([`peek_completed`](Store::peek_completed) answering every completed outcome,
    /// never `None` to save a round trip): a claim limit counts only the calls that
    /// find none. The default does nothing, for a store whose reads always answer.
    fn read_before_claims(&self) {}

    /// Whether the store can hold a count of new claims shared by every `Idem` on it
    /// ([`take_claim_token`](Store::take_claim_token)). The default says it cannot.
    fn shares_claim_counts(&self) -> bool {
        false
    }

    /// Takes one new claim from `key`'s allowance of `burst` at once and one more every
    /// `every` (GCRA, by the store's clock), as one atomic step: `None` when it was
    /// allowed, else how long until one is (and nothing was taken). The store keeps
    /// `key`'s count no longer than its allowance needs. The default says the store
    /// cannot hold the count ([`shares_claim_counts`](Store::shares_claim_counts)).
    fn take_claim_token<'a>(
        &'a self,
        key: &'a str,
        burst: u32,
        every: Duration,
    ) -> StoreFuture<'a, Result<Option<Duration>, StoreError>> {
        let _ = (key, burst, every);
        StoreFuture::ready(Err(StoreError::new(
            false,
            "this store cannot hold a shared claim count; drop `ClaimLimit::shared` to \
             count per process, or keep idem's records on PostgreSQL or Redis",
        )))
    }
}

/// The operator's side of a store: what [`Idem`](crate::Idem)'s operator methods and the
/// `idem` CLI call (listing, inspecting, reconciling, purging), never a call's hot path.
/// Every [`Store`] is one. Implemented with [`async_trait`](https://docs.rs/async-trait).
#[async_trait::async_trait]
pub trait Admin: Send + Sync + 'static {
    /// Settles an UNKNOWN or IN_PROGRESS record held at `epoch`: `None` removes it (the
    /// next call runs the body), `Some` records that outcome for `retain`. With `None`,
    /// an operation with recorded steps is released as [`release`](Store::release)
    /// does, so that the next call resumes it, and kept for [`RESUME_WINDOW`].
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError>;

    /// Deletes the record held at `epoch` for an operator: a COMPLETED or UNKNOWN one, or
    /// an IN_PROGRESS one whose lease has lapsed by the store's clock; never a claim whose
    /// lease holds. The next call then runs the body. One atomic step, fenced like
    /// [`resolve`](Admin::resolve): [`Fence::Lost`] when the record is gone, at another
    /// epoch, or in progress under a live lease. Epochs still never repeat. The default
    /// says the store cannot forget records.
    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        let _ = (id, epoch);
        Err(StoreError::new(
            false,
            "this store cannot forget a record; implement `Admin::forget` for it",
        ))
    }

    /// Deletes COMPLETED records past their retention, and records released with their
    /// steps past theirs (see [`release`](Store::release)), steps and all; returns how
    /// many.
    async fn purge_expired(&self) -> Result<u64, StoreError>;

    /// Counts by state.
    async fn stats(&self) -> Result<Stats, StoreError>;

    /// Records matching `filter`, oldest first.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError>;

    /// One record in full, for operators. The default says the store cannot show it.
    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let _ = id;
        Err(StoreError::new(
            false,
            "this store cannot show a single record",
        ))
    }
}

fn no_steps() -> StoreError {
    StoreError::new(
        false,
        "this store does not keep steps; implement `Store::record_step` and `Store::steps` \
         for it, or use one of idem's stores",
    )
}

macro_rules! forward_store {
    ($($ptr:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $ptr {
            fn claim<'a>(&'a self, req: &'a ClaimRequest<'a>) -> StoreFuture<'a, Result<Claim, StoreError>> {
                (**self).claim(req)
            }
            fn peek_completed<'a>(
                &'a self,
                id: &'a OperationId,
                fingerprint: &'a [u8; 32],
            ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
                (**self).peek_completed(id, fingerprint)
            }
            fn record<'a>(&'a self, id: &'a OperationId, epoch: u64, outcome: &'a StoredOutcome, retain: Duration) -> StoreFuture<'a, Result<Fence, StoreError>> {
                (**self).record(id, epoch, outcome, retain)
            }
            fn release<'a>(&'a self, id: &'a OperationId, epoch: u64, retain: Duration) -> StoreFuture<'a, Result<Fence, StoreError>> {
                (**self).release(id, epoch, retain)
            }
            fn mark_unknown<'a>(&'a self, id: &'a OperationId, epoch: u64) -> StoreFuture<'a, Result<Fence, StoreError>> {
                (**self).mark_unknown(id, epoch)
            }
            fn renew<'a>(&'a self, id: &'a OperationId, epoch: u64, lease: Duration) -> StoreFuture<'a, Result<Fence, StoreError>> {
                (**self).renew(id, epoch, lease)
            }
            fn record_step<'a>(&'a self, id: &'a OperationId, epoch: u64, label: &'a str, outcome: &'a StoredOutcome) -> StoreFuture<'a, Result<Fence, StoreError>> {
                (**self).record_step(id, epoch, label, outcome)
            }
            fn steps<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
                (**self).steps(id)
            }
            fn announce_wait<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<(), StoreError>> {
                (**self).announce_wait(id)
            }
            fn attach_wakers(&self, hub: std::sync::Arc<WakeHub>) {
                (**self).attach_wakers(hub)
            }
            fn read_before_claims(&self) {
                (**self).read_before_claims()
            }
            fn shares_claim_counts(&self) -> bool {
                (**self).shares_claim_counts()
            }
            fn take_claim_token<'a>(&'a self, key: &'a str, burst: u32, every: Duration) -> StoreFuture<'a, Result<Option<Duration>, StoreError>> {
                (**self).take_claim_token(key, burst, every)
            }
        }

        #[async_trait::async_trait]
        impl<S: Admin + ?Sized> Admin for $ptr {
            async fn resolve(&self, id: &OperationId, epoch: u64, completed: Option<(&StoredOutcome, Duration)>) -> Result<Fence, StoreError> {
                (**self).resolve(id, epoch, completed).await
            }
            async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
                (**self).forget(id, epoch).await
            }
            async fn purge_expired(&self) -> Result<u64, StoreError> {
                (**self).purge_expired().await
            }
            async fn stats(&self) -> Result<Stats, StoreError> {
                (**self).stats().await
            }
            async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
                (**self).list(filter).await
            }
            async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
                (**self).get(id).await
            }
        }
    )*};
}
// A shared or boxed store is a store, so wrappers (metrics, fault injection) compose.
forward_store!(std::sync::Arc<S>, Box<S>);
