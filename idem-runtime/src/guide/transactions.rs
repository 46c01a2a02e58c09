//! Transactional mode: the claim and the record run inside the caller's own sqlx
//! transaction, beside the body's writes, and commit or roll back with them.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # mod example {
//! use idem_runtime::{BoxError, Idem, idempotent};
//! use sqlx::{Sqlite, SqlitePool, Transaction};
//!
//! #[idempotent(store = idem, tx = tx, key = order_id, retain = "30d")]
//! async fn place_order(
//!     idem: &Idem,
//!     tx: &mut Transaction<'_, Sqlite>,
//!     order_id: &str,
//!     qty: i64,
//! ) -> Result<i64, BoxError> {
//!     sqlx::query("INSERT INTO orders (id, qty) VALUES (?1, ?2)")
//!         .bind(order_id)
//!         .bind(qty)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(qty)
//! }
//!
//! # pub async fn main() -> Result<(), BoxError> {
//! // One connection: the orders, idem's table and the transactions share the database.
//! let pool = sqlx::sqlite::SqlitePoolOptions::new()
//!     .max_connections(1)
//!     .connect("sqlite::memory:")
//!     .await?;
//! sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
//!     .execute(&pool)
//!     .await?;
//! let idem = Idem::from_pool(pool.clone()).await?;
//! for _ in 0..2 {
//!     // On SQLite, take the write lock at once, so a duplicate waits on it.
//!     let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
//!     place_order(&idem, &mut tx, "o-1", 3).await?;
//!     tx.commit().await?;
//! }
//! let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(&pool).await?;
//! assert_eq!(rows, 1); // the second transaction replayed the outcome and wrote nothing
//! # Ok(()) }
//! # }
//! # #[cfg(feature = "sqlite")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idem_runtime::BoxError> { example::main().await }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```
//!
//! `tx = tx` names a parameter `tx: &mut sqlx::Transaction<'_, DB>` on PostgreSQL,
//! MySQL/MariaDB or SQLite (any [`TxConnection`](crate::TxConnection)), opened on the
//! database that holds idem's table. The `tx` parameter is not fingerprinted. Without
//! the attribute, [`Operation::begin_tx`](crate::Operation::begin_tx) and
//! [`TxGuard::finish`](crate::TxGuard::finish) are the same two halves.
//!
//! # What happens in the transaction
//!
//! The row lock is the claim and rollback is the release. idem adds five statements to
//! the transaction and no round trip outside it:
//!
//! 1. a savepoint, `idem_body_<n>`, taken before the claim;
//! 2. the claim: a fresh claim, or a replay of an outcome an earlier transaction
//!    committed, or a mismatch;
//! 3. a second savepoint, `idem_run_<n>`, after the claim, before the body;
//! 4. the body's own statements, then the record of its outcome;
//! 5. the release of the first savepoint.
//!
//! `n` is a number no other operation in the process takes, so each operation's
//! savepoints have names of their own: operations nested in one transaction (an
//! idempotent function calling another with the same `tx`) each roll back to and
//! release only their own, on every database, MySQL included, where a second savepoint
//! of one name would replace the first.
//!
//! A released `Err` (the default `errors = release`) rolls back to the first savepoint,
//! so a caller who commits after an `Err` keeps neither the body's writes nor the claim.
//! A recorded `Err` (`errors = record`) survives the body's own failed SQL: idem rolls
//! back to the second savepoint, dropping the body's writes (which an aborted PostgreSQL
//! transaction could not commit anyway), and records the error; the caller gets its
//! error, never a store error in its place. An `Err` classified
//! [`Disposition::Unknown`](crate::Disposition::Unknown) is recorded like `Record`: the
//! body's writes commit or roll back with the transaction, so nothing inside it is in
//! doubt. [`current()`](crate::current) works in a transactional body as in any other.
//!
//! `in_flight`, `on_takeover` and `on_store_error = fail_open` do not apply and are
//! compile errors with `tx`. `lease` (default `"60s"`) still does: if the body is
//! cancelled and the caller commits anyway, the claim is committed IN_PROGRESS with no
//! body to finish it; it holds its key until the lease lapses, and the next call,
//! transactional or not, then takes it over. While the transaction is open, duplicates
//! block on its row lock whatever the lease.
//!
//! # Per database
//!
//! - **PostgreSQL**: a concurrent duplicate blocks on the row (bounded by the caller's
//!   `lock_timeout`), then replays the committed outcome, or claims afresh if the first
//!   transaction rolled back, under READ COMMITTED. Under REPEATABLE READ or
//!   SERIALIZABLE the conflict is a serialization failure: [`IdemError::Store`] with
//!   [`is_retryable()`](crate::IdemError::is_retryable) `== true`; retry the whole
//!   transaction. Times use `clock_timestamp()`, so a long transaction does not age its
//!   own claim.
//! - **SQLite** has no row locks: begin with `pool.begin_with("BEGIN IMMEDIATE")`, so a
//!   duplicate waits on the database lock (up to `busy_timeout`) instead of failing when
//!   its read transaction tries to write.
//! - **MySQL / MariaDB**: the claim is an insert whose `ON DUPLICATE KEY UPDATE` changes
//!   nothing but takes the row lock, so a duplicate blocks until the first transaction
//!   ends (up to `innodb_lock_wait_timeout`), then reads the committed row with a
//!   locking read (whatever its own snapshot) and replays it, or claims it after a
//!   rollback. A deadlock (1213) or a lock-wait timeout (1205) is a retryable
//!   [`IdemError::Store`]; a deadlock, or a lock-wait timeout under
//!   `innodb_rollback_on_timeout`, has rolled the whole transaction back, claim
//!   included, so retry the transaction.
//! - **Redis** has no transactional mode. It would commit the outcome in the same
//!   transaction as the body's own writes, and those live in another database, which a
//!   Redis `MULTI` can neither join nor roll back. Use a SQL store for it.
//!
//! A claim that vanished from the transaction for another reason (the body rolled back
//! to, or released, its operation's savepoint `idem_body_<n>`) is an
//! [`IdemError::Config`] on every database: nothing was recorded, so roll the
//! transaction back.
//!
//! The workspace's `examples/orders_tx.rs` places an order and decrements stock in one
//! PostgreSQL transaction; `examples/agent_tools.rs` and `examples/queue_consumer.rs`
//! write each effect in transactional mode on SQLite.
//!
//! [`IdemError::Config`]: crate::IdemError::Config
//! [`IdemError::Store`]: crate::IdemError::Store
