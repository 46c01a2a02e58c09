//! The store on MySQL or MariaDB: one InnoDB table, the claim an upsert that decides
//! and a read of what it decided, leases by the database's clock.
//!
//! ```no_run
//! use idem_runtime::{Idem, IdemError};
//!
//! # async fn open() -> Result<(), IdemError> {
//! let idem = Idem::mysql("mysql://app:secret@db.internal:3306/app").await?;
//!
//! // Or the application's pool, with a table of its own name:
//! let pool = sqlx::MySqlPool::connect_lazy("mysql://app:secret@db.internal:3306/app")
//!     .map_err(|e| IdemError::Config { message: e.to_string() })?;
//! let idem = Idem::builder().table("payments_idem").pool(pool).await?;
//! # let _ = idem; Ok(()) }
//! ```
//!
//! # Table and migrations
//!
//! Records live in one InnoDB table of the URL's database
//! ([`table`](crate::IdemBuilder::table) names it, without a database qualification).
//! Scope, name and key are `VARBINARY(255)`, compared byte for byte (no collation folds
//! `A` into `a`); idem caps keys and scopes at 255 bytes, so the primary key fits
//! InnoDB's index limit under every row format. Migrations run on open under a named
//! lock (`GET_LOCK('idem_migrations')`, held by the migrating connection, which is
//! closed afterwards), so several processes can open at once: DDL commits implicitly on
//! MySQL, so the lock is what serializes them, and every statement is idempotent. idem
//! keeps its own bookkeeping in `idem_schema_migrations`. The migrations need `CREATE`
//! and, for the claim's stored procedure, `CREATE ROUTINE` (`CREATE PROCEDURE IF NOT
//! EXISTS`: MariaDB 10.1.3 or MySQL 8.0.29 and later). With
//! [`migrate(false)`](crate::IdemBuilder::migrate), create the table and the procedure
//! from [`MYSQL_SCHEMA_SQL`](crate::schema::MYSQL_SCHEMA_SQL) (or `idem schema mysql
//! --table <name>`), sent whole (as `sqlx::raw_sql` does) or, in the `mysql` client,
//! with a `DELIMITER` around the procedure, whose body holds `;`s; opening checks that
//! the procedure is there.
//!
//! # The claim
//!
//! MySQL cannot return the row an upsert wrote, so the claim is an upsert that decides,
//! followed by a read of the row it decided, in one transaction on one connection. It
//! runs on the server, as a stored procedure (`<table>_claim_v2`, `SQL SECURITY
//! INVOKER`) that idem's fourth migration creates (the third's `<table>_claim` stays
//! for processes of the earlier version): one `CALL`, one round trip, answered with the
//! row decided. The procedure rolls its transaction back on any error and raises the
//! error again as it was.
//!
//! 1. `INSERT ... ON DUPLICATE KEY UPDATE` inserts a fresh claim, or takes an existing
//!    row over when it is expired (a COMPLETED record past its retention, or one
//!    released with its steps past its expiry), a lapsed lease of the same fingerprint
//!    or a record released with steps of the same fingerprint, or leaves it alone. A per-attempt random token written into the row
//!    says whether this claim wrote it.
//! 2. The upsert holds the row's exclusive lock until commit, so the `SELECT ... FOR
//!    UPDATE` after it reads exactly the row the upsert left.
//!
//! The write decides and the read only reports: never a read followed by a write. The
//! upsert's assignments rely on MySQL's left-to-right evaluation (the decision is
//! assigned first, the state last, so every assignment between judges the row as it
//! was); MariaDB's `SIMULTANEOUS_ASSIGNMENT` SQL mode would change that and is refused
//! at open. A deadlock between claims on one key (InnoDB's gap locks when a key is
//! deleted and inserted at once) rolls the claim's transaction back whole, and the claim
//! is issued again, up to 8 times with a short backoff. Fenced writes (record, release,
//! renew, UNKNOWN, resolve) are `UPDATE` or `DELETE` statements on `epoch = ?`, held
//! when they matched a row: one statement each, except that a release (or a retry's
//! resolve) tries the delete of a record without steps first and, only when the record
//! has [steps](crate::step), keeps it released, and that a step's record locks the
//! operation's row, then writes the step, in one transaction sent as one multi-statement
//! query (its values written in as hex and decimal literals). A fresh call is two round
//! trips (the claim's `CALL`, then the record) and two commits. sqlx's pool adds a ping
//! as each connection goes back to it, after the answer; idem's own pool pings a
//! connection it hands out only when it sat idle for over a second (an application's
//! pool, as it is built: sqlx pings on every acquire by default).
//!
//! # Replays read first, once replays come in
//!
//! A COMPLETED, unexpired record is final until it expires, so a plain read that finds
//! one answers a replay (or a mismatch) in one round trip, with no lock taken and no row
//! written, where the claim's transaction writes and commits. A fresh call would pay that
//! read for nothing, so the store issues it only while it has seen replays lately: each
//! replay raises a score by 8 (up to 64), each fresh claim lowers it by 1, and the read
//! runs while it is above zero. A stream of new calls goes straight to the claim; a burst of
//! retries is served by reads after its first replay.
//!
//! # Epochs
//!
//! Epochs come from an `AUTO_INCREMENT` counter table (`<table>_epoch_seq`). A claim the
//! upsert made carries epoch 0 until, in the same transaction (within the procedure), it
//! inserts a counter row,
//! takes `LAST_INSERT_ID()` as its epoch and deletes the row; a replay or an in-flight
//! answer draws none. Epochs therefore never repeat for the table, whatever was
//! released, resolved or purged. InnoDB keeps the counter across restarts on MySQL 8.0
//! and MariaDB 10.2.4 and later; older servers reset it to the highest row left.
//! Transactional mode draws one epoch per claim attempt.
//!
//! # The clock
//!
//! Unix milliseconds from `UTC_TIMESTAMP(3)`, which MySQL fixes for the whole statement
//! and which no session time zone or daylight-saving change can shift.
//!
//! # Connections and wake-ups
//!
//! [`Idem::mysql`](crate::Idem::mysql) opens one sqlx pool of up to
//! [`max_connections`](crate::IdemBuilder::max_connections) (16 by default) for
//! everything; on the application's pool idem holds none of its own, and transactional
//! mode uses the caller's connection. There is no cross-process wake-up: waiters in
//! other processes re-issue the claim every
//! [`poll_interval`](crate::IdemBuilder::poll_interval) (200 ms by default).
//!
//! # Errors
//!
//! - Deadlock (1213), lock-wait timeout (1205) and too many connections (1040) are
//!   retryable [`IdemError::Store`](crate::IdemError::Store) errors: retry the call, or
//!   in transactional mode the transaction.
//! - A lost or refused connection, a pool timeout, a server shutting down (1053) or a
//!   killed connection (1927) are *unreachable*, the only errors `fail_open` acts on.
//! - A read-only server (a replica, or a primary being demoted: errors 1290, 1836,
//!   1792) refuses idem's writes with a retryable store error, never an unreachable one:
//!   the body does not run and `fail_open` does not run it either. `read_only` does not
//!   bind users with `SUPER` or `READ_ONLY ADMIN`, so such a user's writes still
//!   succeed there.
//! - Everything else (a refusal, a constraint, data too long) fails closed.
//!
//! # What is tested
//!
//! The behaviour suite, the conformance suite, the contention tests, the model test and
//! the transactional suite run on MariaDB 10.11 at `IDEM_MYSQL_URL`, beside two OS
//! processes racing in transactional mode on 1,000 keys, and a replay answered while
//! another transaction holds the record's row lock.
