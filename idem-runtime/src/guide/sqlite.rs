//! The embedded store: one SQLite table in a file (WAL mode, `synchronous=FULL`) or in
//! memory, for one host.
//!
//! ```
//! use idem_runtime::{Idem, IdemError};
//! use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! let path = std::env::temp_dir().join(format!("idem-guide-{}.db", std::process::id()));
//! // The file is created if missing, in WAL mode, and the schema on open.
//! let idem = Idem::builder()
//!     .table("billing_idem")
//!     .sqlite(&format!("sqlite://{}", path.display()))
//!     .await?;
//! let receipt = idem
//!     .operation("charge", "order-1")
//!     .retain(Duration::from_secs(7 * 86_400))
//!     .fingerprint(&4_999u64)
//!     .run(|| async { Ok::<_, IdemError>(4_999u64) })
//!     .await?;
//! assert_eq!(receipt, 4_999);
//! # drop(idem);
//! # for suffix in ["", "-wal", "-shm"] {
//! #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
//! # }
//! # Ok(()) }
//! ```
//!
//! # Opening
//!
//! [`Idem::sqlite`](crate::Idem::sqlite) takes `sqlite://path/to/file.db` (or a bare
//! path) or `sqlite::memory:`. A file is created unless the URL sets a `mode` itself
//! (`mode=rw` means it must exist) and runs in WAL mode, so the replay read runs beside
//! the one writer. An in-memory database lives only as long as a connection to it, so
//! the store keeps one connection open for its whole life. [`Idem::from_pool`](crate::Idem::from_pool)
//! takes the application's `SqlitePool` instead, which
//! [transactional mode](super::transactions) needs. The schema is created on open
//! unless [`migrate(false)`](crate::IdemBuilder::migrate); the DDL ships as
//! [`SQLITE_SCHEMA_SQL`](crate::schema::SQLITE_SCHEMA_SQL). Statements wait up to 5 s
//! for another connection's write lock before SQLite answers busy, which is a
//! retryable [`IdemError::Store`](crate::IdemError::Store).
//!
//! # Statements and the clock
//!
//! Every store method is one statement. Times come from SQLite's clock inside the
//! statement (`unixepoch('subsec')`, fixed for the whole statement), never from the
//! application. SQLite has one writer, so the claim's upsert never races and is
//! issued once. A one-row `<table>_meta` holds the highest epoch ever issued (kept
//! current by triggers inside the claim's own statement) and the key mode the table
//! was created with, so epochs never repeat and opening it with another
//! [`hash_keys`](crate::IdemBuilder::hash_keys) setting is refused.
//! Purge compares expiry with a clock value bound as a parameter, which keeps its plan
//! an index range over `(state, expires_ms)`.
//!
//! # Durability
//!
//! The file runs with `synchronous=FULL`, so a power loss cannot drop a committed claim
//! or record. (With `NORMAL`, WAL's usual setting, the last commits can be lost, and a
//! lost record would let a retry run the body again.)
//!
//! # Group commit
//!
//! With `FULL`, every commit is an fsync, and SQLite has one writer. So concurrent
//! claims and records on one `Idem` are gathered: the next writer takes every write
//! waiting at that moment into one transaction and answers each caller with its own
//! rows. Within a batch, the claims of new keys go in as one statement and the records
//! as another, passed as JSON (this needs SQLite 3.41 or later, as bundled; on an older
//! SQLite every batch fails over to each write alone). A lone write runs alone and
//! nothing waits on a timer. If any write in a batch (or its commit) fails, the batch
//! is rolled back whole and each write runs again by itself, so one refused write never
//! fails its neighbours. A fresh call still commits
//! twice (the claim, then the record), so one caller's rate is bounded by two fsyncs;
//! concurrent callers share them.
//!
//! # Across processes
//!
//! Several processes may open one file. There is no cross-process wake-up: a caller
//! waiting on another process's claim re-issues the claim every
//! [`poll_interval`](crate::IdemBuilder::poll_interval) (200 ms by default). Waiters in
//! the same process are woken at once.
