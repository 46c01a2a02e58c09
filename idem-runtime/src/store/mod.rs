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
//! A SQL backend is one module, `store/<db>.rs`, with its statements in `sql/<db>/` and
//! its DDL in `migrations/<db>/`. The engine (`SqlStore` over a `Dialect`, in
//! `store/engine.rs`) does the rest: claims, replays, records, fencing, renewals, purge,
//! listing, migrations and transactional mode. To add one:
//!
//! 1. `sql/<db>/`: one file per statement the engine issues (the names in `engine.rs`'s
//!    `statements!`, the `tx_*` ones for transactional mode among them), written with
//!    named parameters (`:scope`, `:epoch`, ...) and the engine's names (`{table}`,
//!    `{steps}`, `{now}`, `{lapsed}`, `{expired}`, `{released}`, `{next_epoch}`); the
//!    fragments `lapsed`, `expired` and `released` are files too, and `record_step` and
//!    `steps` keep an operation's [steps](crate::step) (the operations table's `steps`
//!    column says whether its current life has any); optional statements (`peek`,
//!    `claim_fresh`, `wake`, ...) are named in the dialect's own `statements!` call.
//! 2. `migrations/<db>/`: the DDL in order, which the module lists as its `MIGRATIONS`
//!    and publishes as `<DB>_SCHEMA_SQL`.
//! 3. `store/<db>.rs`: a dialect (a `pub` struct holding the pool) implementing
//!    `Dialect`. Required: `Db`, `Conn`, `NOW`, `NEXT_EPOCH`, `SCHEMA`, `sql`,
//!    `placeholder`, `map_err`, `fetch`, `begin_migrations`, `run_script`, `execute`,
//!    `from_pool`. Defaulted, overridden where the database differs:
//!    `CLAIM_ATTEMPTS` and `is_conflict` (a claim a concurrent commit can void),
//!    `is_lock_wait` (the purge), `NUMBERED_PLACEHOLDERS`, `PEEK_WHILE_REPLAYING`,
//!    `PEEK_ON_HOT`, `claim_token`, `attach_wakers` (wake-ups from other processes),
//!    `gathers` and `gathered` (group commit), and for transactional mode
//!    `transaction_gone` (whether the server rolled the caller's transaction back on its
//!    own; transactional mode runs its savepoints through `run_script`). Then
//!    `impl SqlDb for sqlx::<Db> { type Dialect = <the dialect>; }`: with it the
//!    database's `sqlx::Transaction` is a [`TxConnection`](crate::TxConnection) and its
//!    `sqlx::Pool` an [`IntoStore`](crate::IntoStore), with nothing else to write. And
//!    `open(url, &SqlOptions)` for its opener.
//! 4. Outside the module, one line or a few each: its feature in `Cargo.toml`, enabling
//!    `_sql` (`_sql_server` for a server reached by URL) and the sqlx driver;
//!    `mod <db>;` here; `Idem::<db>` and `IdemBuilder::<db>` in `builder.rs`; its
//!    `<DB>_SCHEMA_SQL` in `lib.rs`'s `schema`; its page in `guide/`.
//!
//! What proves it: `conformance::run_all` on the store its `IdemBuilder::<db>` opens
//! (`tests/suite/conformance.rs` takes it through the builder's `layer` hook), and
//! `conformance::tx::run_all` on a `TxTarget` of its pool, an `Idem::from_pool` on that
//! pool and a business table (`tests/suite/transactional.rs`, after a `TxDatabase` impl
//! for the database in `store/conformance/tx/database.rs`, whose checks write that table
//! with statements of their own).

#[doc(hidden)]
pub mod conformance;
mod delegate;
mod future;
mod memory;
#[cfg(all(test, any(feature = "sqlite", feature = "postgres")))]
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
#[cfg(feature = "_sql")]
pub(crate) mod engine;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod group;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

/// What the benches read of the stores. Not a stable API.
#[cfg(feature = "_sql_server")]
#[doc(hidden)]
pub mod bench {
    /// The MySQL statement file `name` (`sql/mysql/<name>.sql`) rendered for `table`,
    /// exactly as the store issues it: each statement with `?` placeholders, and the
    /// names of the parameters those placeholders take, in order.
    #[cfg(feature = "mysql")]
    pub fn mysql_statements(
        name: &str,
        table: &str,
    ) -> Result<Vec<(String, Vec<String>)>, crate::IdemError> {
        use super::engine::{Dialect, Stmt};
        let table = super::sql_common::TableName::parse(table, false)?.backticked();
        let stmt = Stmt::render::<super::mysql::MySql>(super::mysql::MySql::sql(name), &table);
        Ok(super::mysql::parts_with_params(&stmt))
    }

    /// The PostgreSQL statement `name` (`sql/postgres/<name>.sql`) rendered for `table`,
    /// exactly as the store issues it.
    #[cfg(feature = "postgres")]
    pub fn postgres_statement(name: &str, table: &str) -> Result<String, crate::IdemError> {
        use super::engine::{Dialect, Stmt};
        let table = super::sql_common::TableName::parse(table, true)?;
        Ok(Stmt::render::<super::postgres::Pg>(super::postgres::Pg::sql(name), &table).sql)
    }
}
#[cfg(feature = "_sql")]
pub(crate) mod sql_common;
#[cfg(feature = "_sql")]
pub(crate) mod sql_handle;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

use std::time::Duration;

pub use crate::error::StoreError;

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

/// The identity of one operation: its scope, name and key, each already encoded.
///
/// ```
/// use idem_runtime::{Idem, IdemError, current};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// let op = idem
///     .operation("charge", "order-1")
///     .scope("acme")
///     .retain(Duration::from_secs(3600))
///     .fingerprint_none();
/// let id = op.id().clone();
/// let inside = op.run(|| async { Ok::<_, IdemError>(current().downstream_key("psp")) }).await?;
/// // What a reconciler computes from a listed record is what the body passed on.
/// assert_eq!(inside, id.downstream_key("psp"));
/// assert_eq!(id.name, "charge");
/// # Ok(()) }
/// ```
#[derive(
    Clone,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct OperationId {
    /// The encoded scope (`""` for the empty scope).
    pub scope: String,
    /// The operation's name.
    pub name: String,
    /// The encoded key.
    pub key: String,
}

impl OperationId {
    /// The scope as the application passed it, for tables and logs ([`DisplayKey`]).
    ///
    /// [`DisplayKey`]: crate::DisplayKey
    pub fn display_scope(&self) -> crate::DisplayKey<'_> {
        crate::DisplayKey::new(&self.scope)
    }

    /// The key as the application passed it, for tables and logs ([`DisplayKey`]).
    ///
    /// ```
    /// use idem_runtime::{Idem, KeyPart};
    ///
    /// let idem = Idem::memory();
    /// let op = idem.operation("charge", &("acme", 7)).scope("eu");
    /// let id = op.id();
    /// assert_eq!(id.key, ("acme", 7).encode_key());
    /// assert_eq!(id.display_key().to_string(), "(acme, 7)");
    /// assert_eq!(id.display_scope().to_string(), "eu");
    /// ```
    ///
    /// [`DisplayKey`]: crate::DisplayKey
    pub fn display_key(&self) -> crate::DisplayKey<'_> {
        crate::DisplayKey::new(&self.key)
    }

    /// The operation name made safe for a terminal (control characters escaped).
    pub fn display_name(&self) -> crate::DisplayKey<'_> {
        crate::DisplayKey::plain(&self.name)
    }

    /// The key a body passes to a downstream system for `label`, as
    /// [`Current::downstream_key`](crate::Current::downstream_key) gives it inside the
    /// body: a reconciler looking at an UNKNOWN record asks the downstream system about
    /// this key.
    pub fn downstream_key(&self, label: &str) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"idem-downstream-v1");
        for part in [
            self.scope.as_str(),
            self.name.as_str(),
            self.key.as_str(),
            label,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let mut out = String::with_capacity(64);
        for b in h.finalize() {
            use std::fmt::Write;
            let _ = write!(out, "{b:02x}");
        }
        out
    }
}

impl std::fmt::Display for OperationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.display_scope(),
            self.display_name(),
            self.display_key()
        )
    }
}

/// What a lapsed claim turns into when another caller finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Takeover {
    /// The next claimant runs the body again, with a higher epoch.
    #[default]
    Rerun,
    /// The operation goes to UNKNOWN, for effects with no downstream deduplication.
    Unknown,
}

/// One claim attempt.
#[derive(Clone, Debug)]
pub struct ClaimRequest<'a> {
    /// The operation.
    pub id: &'a OperationId,
    /// The request fingerprint, bound to the key at first claim.
    pub fingerprint: [u8; 32],
    /// How long the claim is owned before another caller may take over.
    pub lease: Duration,
    /// What a lapsed claim turns into.
    pub on_takeover: Takeover,
}

/// A recorded outcome as the store keeps it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredOutcome {
    /// Whether the body returned `Err` (recorded under `errors = record` or `classify`).
    pub is_err: bool,
    /// The outcome's schema version.
    pub version: u32,
    /// The outcome, as JSON: shared, so a store in this process and the replays that
    /// read it hold one copy.
    pub body: std::sync::Arc<[u8]>,
}

impl StoredOutcome {
    /// An outcome as a store read it back: its JSON `body`, whether it is a recorded
    /// `Err`, and its schema version.
    pub fn new(body: impl Into<std::sync::Arc<[u8]>>, is_err: bool, version: u32) -> Self {
        StoredOutcome {
            is_err,
            version,
            body: body.into(),
        }
    }

    pub(crate) fn view(&self) -> OutcomeRef<'_> {
        OutcomeRef {
            is_err: self.is_err,
            version: self.version,
            body: &self.body,
        }
    }
}

/// A recorded outcome borrowed from wherever it is kept, for decoding.
#[derive(Clone, Copy)]
pub(crate) struct OutcomeRef<'a> {
    pub(crate) is_err: bool,
    pub(crate) version: u32,
    pub(crate) body: &'a [u8],
}

/// What the atomic claim decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This caller owns the operation at `epoch` and must run the body.
    Acquired {
        /// The epoch to fence later writes on: 1 for a fresh claim, higher after a takeover.
        epoch: u64,
        /// Whether a lapsed claim was taken over.
        takeover: bool,
        /// Whether the operation has recorded [steps](crate::step) that this run resumes
        /// (after a takeover, a released error or `resolve(.., Retry)`): the caller reads
        /// them once with [`Store::steps`]. `false` for a claim that starts the
        /// operation afresh, which then costs no read.
        resume: bool,
    },
    /// The operation completed; here is its outcome.
    Completed(StoredOutcome),
    /// Another caller holds a live claim.
    InFlight {
        /// The lease's remaining time by the store's clock.
        retry_after: Duration,
    },
    /// The key is bound to another fingerprint.
    Mismatch,
    /// The operation is UNKNOWN.
    Unknown {
        /// The epoch whose effect is unknown.
        epoch: u64,
        /// Whether this claim moved it there (a lapsed lease under [`Takeover::Unknown`]).
        now: bool,
    },
}

/// How an operator settles an UNKNOWN (or stuck IN_PROGRESS) operation, with
/// [`Idem::resolve`](crate::Idem::resolve).
///
/// ```
/// use idem_runtime::{Idem, IdemError, ListFilter, Resolution};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// # let idem = Idem::memory();
/// for record in idem.list(&ListFilter::unknown()).await? {
///     // The downstream system says the effect never happened: let the next call run.
///     idem.resolve(&record.id, record.epoch, Resolution::Retry).await?;
/// }
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub enum Resolution {
    /// The effect did not happen: remove the record so the next call runs the body. An
    /// operation with recorded [steps](crate::step) keeps them and its fingerprint, and
    /// the next call with the same request resumes it: its steps replay. It keeps them
    /// for [`RESUME_WINDOW`], then expires.
    Retry,
    /// The effect happened: record this outcome (the JSON of the function's `Ok` value)
    /// so later calls replay it.
    Completed {
        /// The outcome, as the JSON of the operation's `Ok` type.
        outcome: serde_json::Value,
        /// Its schema version.
        version: u32,
        /// How long to keep it.
        retain: Duration,
    },
    /// The effect was refused: record this error (the JSON of the function's `Err`
    /// value, which must then be recordable) so later calls replay it as `Err`.
    Rejected {
        /// The error, as the JSON of the operation's `Err` type.
        error: serde_json::Value,
        /// Its schema version.
        version: u32,
        /// How long to keep it.
        retain: Duration,
    },
}

/// A record's state.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum State {
    /// A claim is held.
    InProgress,
    /// An outcome is recorded.
    Completed,
    /// The effect of an attempt is unknown.
    Unknown,
}

impl State {
    /// The state's code as stored in SQL tables.
    pub fn code(self) -> i16 {
        match self {
            State::InProgress => 0,
            State::Completed => 1,
            State::Unknown => 2,
        }
    }

    /// The state for a stored code.
    pub fn from_code(code: i64) -> Option<State> {
        match code {
            0 => Some(State::InProgress),
            1 => Some(State::Completed),
            2 => Some(State::Unknown),
            _ => None,
        }
    }
}

/// One record, as [`Idem::list`](crate::Idem::list) shows it. The outcome is left out.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordInfo {
    /// The operation.
    pub id: OperationId,
    /// Its state.
    pub state: State,
    /// Its current epoch.
    pub epoch: u64,
    /// How long ago the record was created or last claimed, by the store's clock.
    pub age: Duration,
}

impl RecordInfo {
    /// A record as a store lists it.
    pub fn new(id: OperationId, state: State, epoch: u64, age: Duration) -> Self {
        RecordInfo {
            id,
            state,
            epoch,
            age,
        }
    }
}

/// One record in full, as [`Idem::get`](crate::Idem::get) shows it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordDetail {
    /// Its identity, state, epoch and age.
    pub info: RecordInfo,
    /// For IN_PROGRESS: how long the lease still runs by the store's clock (zero once
    /// lapsed).
    pub lease_remaining: Option<Duration>,
    /// For COMPLETED, and for IN_PROGRESS released with its steps kept
    /// ([`Store::release`]): how long until the record expires (zero once expired).
    pub expires_in: Option<Duration>,
    /// For COMPLETED: the recorded outcome.
    pub outcome: Option<StoredOutcome>,
    /// The operation's completed [steps](crate::step), oldest first: what an
    /// operator reconciling an UNKNOWN operation needs to know. Empty for an operation
    /// without steps, and for a completed one (its final outcome is what counts).
    /// [`Idem::get`](crate::Idem::get) fills it; a store's `get` leaves it empty.
    pub steps: Vec<StepRecord>,
}

impl RecordDetail {
    /// A record with nothing more known of it than `info`; a store sets the fields its
    /// state has.
    pub fn new(info: RecordInfo) -> Self {
        RecordDetail {
            info,
            lease_remaining: None,
            expires_in: None,
            outcome: None,
            steps: Vec::new(),
        }
    }
}

/// One completed [step](crate::step) of an operation, as the store keeps it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    /// The step's label, unique within its operation.
    pub label: String,
    /// The epoch of the attempt that ran and recorded it.
    pub epoch: u64,
    /// How long ago it was recorded, by the store's clock.
    pub age: Duration,
    /// The step's `Ok` value, encoded like an operation's outcome.
    pub outcome: StoredOutcome,
}

impl StepRecord {
    /// A step as a store read it back.
    pub fn new(label: String, epoch: u64, age: Duration, outcome: StoredOutcome) -> Self {
        StepRecord {
            label,
            epoch,
            age,
            outcome,
        }
    }
}

/// Which records [`Idem::list`](crate::Idem::list) returns: built from
/// [`ListFilter::default`] (every record, oldest first, at most 100) or a shorthand
/// ([`unknown`](Self::unknown), [`stuck`](Self::stuck), [`recent`](Self::recent)), then
/// narrowed by its methods.
///
/// ```
/// use idem_runtime::{Idem, IdemError, ListFilter, State};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// # let idem = Idem::memory();
/// let stuck = idem.list(&ListFilter::stuck(Duration::from_secs(300))).await?;
/// // The last hour's charges, newest first.
/// let charges = ListFilter::recent(Duration::from_secs(3600))
///     .state(State::Completed)
///     .name("charge")
///     .limit(20);
/// let recent = idem.list(&charges).await?;
/// # assert!(stuck.is_empty() && recent.is_empty());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only records in this state.
    pub state: Option<State>,
    /// Only records of this operation name.
    pub name: Option<String>,
    /// Only records in this scope, encoded as [`OperationId::scope`] holds it.
    pub scope: Option<String>,
    /// Only records claimed longer ago than this.
    pub older_than: Option<Duration>,
    /// Only records claimed at most this long ago.
    pub newer_than: Option<Duration>,
    /// Newest first (by claim time); oldest first otherwise.
    pub newest_first: bool,
    /// At most this many (default 100).
    pub limit: Option<u32>,
}

impl ListFilter {
    /// Records in the UNKNOWN state: the reconciliation queue.
    pub fn unknown() -> Self {
        ListFilter::default().state(State::Unknown)
    }

    /// Records in progress for longer than `age`: claims that may be stuck.
    pub fn stuck(age: Duration) -> Self {
        ListFilter::default()
            .state(State::InProgress)
            .older_than(age)
    }

    /// Records claimed within the last `age`, newest first: what just happened.
    pub fn recent(age: Duration) -> Self {
        ListFilter::default().newer_than(age).newest_first()
    }

    /// Only records in `state`.
    pub fn state(mut self, state: State) -> Self {
        self.state = Some(state);
        self
    }

    /// Only records of the operation `name`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Only records in the scope `encoded`, as [`OperationId::scope`] holds it: take it
    /// from an [`Operation::id`](crate::Operation::id), which applies the store's key
    /// mode (`hash_keys`), or encode it with [`KeyPart::encode_key`](crate::KeyPart).
    ///
    /// ```
    /// use idem_runtime::{Idem, ListFilter};
    /// let idem = Idem::memory();
    /// let acme = idem.operation("", "").scope("acme").id().scope.clone();
    /// let filter = ListFilter::default().scope(acme);
    /// # let _ = filter;
    /// ```
    pub fn scope(mut self, encoded: impl Into<String>) -> Self {
        self.scope = Some(encoded.into());
        self
    }

    /// Only records claimed longer ago than `age`.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Only records claimed at most `age` ago.
    pub fn newer_than(mut self, age: Duration) -> Self {
        self.newer_than = Some(age);
        self
    }

    /// Newest records first.
    pub fn newest_first(mut self) -> Self {
        self.newest_first = true;
        self
    }

    /// At most `n` records.
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = Some(n);
        self
    }

    pub(crate) fn max_rows(&self) -> u32 {
        self.limit.unwrap_or(100)
    }
}

/// Orders and cuts the records a store that filters in memory listed, as the SQL stores'
/// `ORDER BY` and `LIMIT` do: by claim time, oldest or newest first, then by identity.
pub(crate) fn sort_listed(rows: &mut Vec<RecordInfo>, filter: &ListFilter) {
    if filter.newest_first {
        rows.sort_by(|a, b| a.age.cmp(&b.age).then_with(|| a.id.cmp(&b.id)));
    } else {
        rows.sort_by(|a, b| b.age.cmp(&a.age).then_with(|| a.id.cmp(&b.id)));
    }
    rows.truncate(filter.max_rows() as usize);
}

/// Counts by state, for alerting on stuck claims; [`Idem::stats`](crate::Idem::stats)
/// reads them.
///
/// ```
/// use idem_runtime::{Idem, IdemError};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// idem.operation("charge", "order-1")
///     .retain(Duration::from_secs(3600))
///     .fingerprint_none()
///     .run(|| async { Ok::<_, IdemError>(()) })
///     .await?;
/// let stats = idem.stats().await?;
/// assert_eq!((stats.completed, stats.in_progress, stats.unknown), (1, 0, 0));
/// assert!(stats.oldest_unknown.is_none()); // alert when this grows
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Records IN_PROGRESS under a claim (not those counted in `released`).
    pub in_progress: u64,
    /// Records COMPLETED (including those past retention, not yet purged).
    pub completed: u64,
    /// Records UNKNOWN.
    pub unknown: u64,
    /// Records IN_PROGRESS that their last call released with its [steps](crate::step)
    /// kept, for a retry to resume until they expire ([`Store::release`]). No call holds
    /// them, so they are not stuck claims.
    pub released: u64,
    /// Age of the oldest IN_PROGRESS record counted in `in_progress`.
    pub oldest_in_progress: Option<Duration>,
    /// Age of the oldest UNKNOWN record.
    pub oldest_unknown: Option<Duration>,
}

impl Stats {
    /// Counts one record in `state`, `age` since its claim, for stores that tally
    /// their records one by one; `released` for an IN_PROGRESS record released with
    /// its steps kept.
    pub(crate) fn count(&mut self, state: State, released: bool, age: Duration) {
        match state {
            State::InProgress if released => self.released += 1,
            State::InProgress => {
                self.in_progress += 1;
                self.oldest_in_progress = self.oldest_in_progress.max(Some(age));
            }
            State::Completed => self.completed += 1,
            State::Unknown => {
                self.unknown += 1;
                self.oldest_unknown = self.oldest_unknown.max(Some(age));
            }
        }
    }
}

/// How long an operation with recorded [steps](crate::step) is kept for its next call
/// to resume after an operator's [`Resolution::Retry`]: [`Admin::resolve`] is not told
/// the operation's retention, so this stands in for it. Past it the record expires, as
/// one released by its own call does past its retention ([`Store::release`]).
pub const RESUME_WINDOW: Duration = Duration::from_secs(7 * 86_400);

/// Whether a fenced write took effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The epoch still held the claim; the write happened.
    Held,
    /// Another epoch owns the record now (or it is gone); nothing was written.
    Lost,
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

/// A completed record exists but is bound to another fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mismatched;

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
