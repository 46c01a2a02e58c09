//! The production store on PostgreSQL: one table, leases and expiry by the database's
//! clock, claims and records on connections idem holds, wake-ups through `NOTIFY`.
//!
//! ```no_run
//! use idem_runtime::{Idem, IdemError};
//!
//! # async fn open() -> Result<(), IdemError> {
//! // idem's own connections for claims and records (the fastest way to open it):
//! let idem = Idem::postgres("postgres://app@db.internal:5432/app").await?;
//!
//! // Or a schema-qualified table whose DDL your migrations apply:
//! let ddl = idem_runtime::schema::POSTGRES_SCHEMA_SQL; // for the default table name
//! # let _ = ddl;
//! let idem = Idem::builder()
//!     .table("billing.idem_operations")
//!     .migrate(false)
//!     .postgres("postgres://app@db.internal:5432/app")
//!     .await?;
//! # let _ = idem; Ok(()) }
//! ```
//!
//! # Schema and migrations
//!
//! One table (`idem_operations` unless [`table`](crate::IdemBuilder::table) says
//! otherwise, schema-qualified if given), a sequence for epochs (`<table>_epoch_seq`),
//! a one-row `<table>_meta` holding the key mode, and `<table>_steps`, the
//! [steps](crate::step) of unfinished operations, one row per (operation, label):
//!
//! ```sql
//! CREATE TABLE idem_operations (
//!     scope TEXT, name TEXT, key TEXT,          -- PRIMARY KEY (scope, name, key)
//!     state SMALLINT,                           -- 0 IN_PROGRESS, 1 COMPLETED, 2 UNKNOWN
//!     epoch BIGINT,                             -- fences late writers after a takeover
//!     fingerprint BYTEA,                        -- SHA-256 of the request, bound at first claim
//!     taken_over BOOLEAN,
//!     lease_until TIMESTAMPTZ, created_at TIMESTAMPTZ, claimed_at TIMESTAMPTZ,
//!     expires_at TIMESTAMPTZ,                   -- COMPLETED, or released with its steps:
//!                                               -- now + retain
//!     outcome BYTEA, outcome_is_err BOOLEAN, outcome_version INTEGER,
//!     waiters BOOLEAN,                          -- someone waits: finishing sends NOTIFY
//!     steps SMALLINT                            -- 0 none, 1 recorded, 2 released with them,
//!                                               -- 3 none yet in this life
//! );
//! CREATE TABLE idem_operations_steps (
//!     scope TEXT, name TEXT, key TEXT, label TEXT,  -- PRIMARY KEY (scope, name, key, label)
//!     seq BIGINT,                               -- the order steps were first recorded in
//!     epoch BIGINT, recorded_at TIMESTAMPTZ,
//!     outcome BYTEA, outcome_is_err BOOLEAN, outcome_version INTEGER
//! );
//! -- partial indexes: (expires_at) WHERE state = 1 and
//! --                  (expires_at) WHERE state = 0 AND steps = 2 for purge,
//! --                  (claimed_at) WHERE state IN (0, 2) for stuck-claim queries
//! ```
//!
//! Migrations run on open inside a transaction holding an advisory lock, so several
//! processes can open at once. idem keeps its own bookkeeping (`idem_schema_migrations`,
//! in the table's schema) and never touches sqlx's `_sqlx_migrations`. With
//! [`migrate(false)`](crate::IdemBuilder::migrate), apply
//! [`POSTGRES_SCHEMA_SQL`](crate::schema::POSTGRES_SCHEMA_SQL) (or `idem schema postgres
//! --table <name>`) yourself.
//!
//! # The clock
//!
//! Times are `clock_timestamp()`, the wall clock when the statement evaluates it;
//! `now()` would be the start of the transaction, which in a caller's long transaction
//! is old. Leases, retention and ages never use the application server's clock.
//!
//! # The claim
//!
//! The claim is one statement and one round trip. It reads the row in its snapshot
//! and, only when that row is absent or claimable, runs an `INSERT ... ON CONFLICT DO
//! UPDATE ... WHERE <claimable>`; it returns either its own claim or the row it found,
//! so one statement decides fresh claim, takeover, replay, in-flight, mismatch and
//! UNKNOWN. A replay is therefore one primary-key read that neither locks nor writes
//! the row, and a fresh call is two statements: the claim and the record.
//!
//! A key with no record is first claimed by a plain `INSERT ... ON CONFLICT DO
//! NOTHING`, lighter for the server than the full claim; it returns no row when the key
//! exists, and the full claim then decides, so only a call on an existing key pays for
//! both. It does not look for the key first: a key that exists draws an epoch it does
//! not use, which leaves a gap in the epochs and costs nothing else.
//!
//! Under READ COMMITTED, when the conflicting row was committed after the statement's
//! snapshot was taken, the statement returns no row; it is then issued again, at most
//! 5 times.
//!
//! # Replays read first, once replays come in
//!
//! The claim statement answers a replay in one round trip and writes nothing, but it
//! carries the insert it does not use. So once the store has seen replays lately (a
//! score each replay raises by 8, up to 64, and each fresh claim lowers by 1), it first
//! issues a plain primary-key read of a COMPLETED, unexpired record; a record found
//! there answers the replay (or the mismatch), anything else goes on to the claim. A
//! stream of new calls never issues the read; a burst of retries (a webhook redelivered,
//! a queue replayed) is served by reads after its first replay.
//!
//! # Wake-ups
//!
//! Waiters in other processes are woken by `NOTIFY` (one `LISTEN` connection per
//! `Idem`, outside the application's pool), sent only when a waiter flagged the row,
//! with polling every [`poll_interval`](crate::IdemBuilder::poll_interval) as the
//! fallback. The record is a plain `UPDATE` returning the flag, and the `NOTIFY`
//! follows it only where the flag is set.
//!
//! # Connections
//!
//! [`Idem::postgres`](crate::Idem::postgres) runs claims, records, releases, renewals
//! and replay reads on connections it holds itself
//! ([`max_connections`](crate::IdemBuilder::max_connections), 16 by default), outside
//! sqlx's pool: a connection goes back only when its statement completed, and one whose
//! statement was cancelled or failed on the wire is closed instead. That is the safety
//! sqlx's ping on release buys, without the round trip. Beside them, a small sqlx pool
//! serves migrations and the operations queries, and one connection listens for
//! wake-ups: `max_connections + 5` in all (see
//! [`IdemBuilder::max_connections`](crate::IdemBuilder::max_connections)). On the
//! application's pool ([`Idem::from_pool`](crate::Idem::from_pool)) idem takes its
//! connections from that pool; the listener adds one of its own.
//!
//! # Group commit
//!
//! While every connection idem may use is busy, a claim does not wait for one: it joins
//! the claims waiting beside it, and one caller issues them all as one statement over
//! arrays, one round trip and one commit, each row decided as its own statement would
//! decide it. Gathered claims first join a plain insert of every new key (keys in
//! order); a claim whose key exists then joins the full claims. Records are gathered
//! the same way, and a gathered record sends its own `NOTIFY` where a waiter flagged
//! the row.
//!
//! - A batch is whatever is waiting, never a timer; a caller that finds a connection
//!   free runs its own statement at once, so a lone call waits on nothing.
//! - One batch of each kind is in flight at a time, written by the caller that took it,
//!   on its own task; if that caller goes away mid-batch, the rest of the batch runs in
//!   a task of its own. A caller whose write a batch took only waits for its answer.
//! - Two calls on one key never share a statement: the second waits for the next.
//! - If the server refuses a batch (a key PostgreSQL cannot store, say), none of it took
//!   effect, and each call is issued alone, so the refusal is only its own caller's; if
//!   the connection fails mid-batch, each caller gets the error its own statement would
//!   have given.
//!
//! Batches form only where callers queue for connections: below saturation the server
//! runs single statements in parallel and flushes their commits together, which a
//! batch cannot beat. [`group_commit(false)`](crate::IdemBuilder::group_commit) turns it
//! off.
//!
//! # Purge
//!
//! [`Idem::purge_expired`](crate::Idem::purge_expired) deletes in batches of 1,000. Each
//! batch takes the oldest expired rows' physical addresses (`ctid`) from the expiry
//! index, in expiry order, and deletes them by address: a tick with nothing to purge
//! touches only the index, and the order keeps PostgreSQL's generic plan for the
//! prepared statement from reading every expired entry for each batch. Expiry is
//! compared with a bound clock value rather than the volatile `clock_timestamp()`,
//! which would keep the index out of use. Rows are not locked before they are deleted
//! (that would write each one twice); the statement waits at most 100 ms for a row lock
//! (a transaction-local `lock_timeout`), and where a row is held by another transaction
//! the rest of the purge locks rows first and skips held ones (`FOR UPDATE SKIP
//! LOCKED`), so a purge neither waits on a caller nor fails.
//!
//! # Errors
//!
//! A connection-level failure, a pool timeout and SQLSTATE classes 08 and 57P are
//! *unreachable*, the only errors `fail_open` acts on. A serialization failure
//! (40001), a deadlock (40P01), a lock timeout (55P03), a cancelled statement (57014)
//! and too many connections (53300) are retryable
//! [`IdemError::Store`](crate::IdemError::Store) errors. A hot
//! standby, a primary being demoted, or `default_transaction_read_only` refuses writes
//! with SQLSTATE 25006: a retryable store error, never an unreachable one, so the body
//! does not run and `fail_open` does not run it either; the connection is closed, so the
//! next one may reach the new primary. A server with no free connection slot refuses
//! the open at once with its reason (SQLSTATE 53300). `TEXT` cannot hold a NUL
//! character, so a key or scope containing `\0` is refused;
//! [`hash_keys`](crate::IdemBuilder::hash_keys) avoids it.
//!
//! # Postgres-wire distributed SQL
//!
//! Not verified: no CockroachDB or YugabyteDB was available to the test suite. idem
//! needs `INSERT ... ON CONFLICT DO UPDATE ... WHERE` inside a `WITH` that is also read
//! in the same statement, `clock_timestamp()`, partial indexes, `bytea`, savepoints
//! (transactional mode), `pg_advisory_xact_lock` for concurrent migrations (skip it
//! with `migrate(false)` and apply the DDL once), and `LISTEN`/`NOTIFY` for
//! cross-process wake-ups (without it, waiters poll every `poll_interval`). Both
//! databases default to or offer SERIALIZABLE, where claim conflicts are retryable
//! [`IdemError::Store`](crate::IdemError::Store) errors.
