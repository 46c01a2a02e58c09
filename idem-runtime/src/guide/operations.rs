//! Running idem: purging expired records, watching for stuck claims, reconciling
//! UNKNOWN operations, metrics, and the `idem` command.
//!
//! ```
//! use idem_runtime::{Disposition, Idem, IdemError, ListFilter, Resolution};
//! use std::time::Duration;
//!
//! #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! struct ChargeError(String);
//! impl From<IdemError> for ChargeError {
//!     fn from(e: IdemError) -> Self { ChargeError(e.to_string()) }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! let idem = Idem::memory();
//! let day = Duration::from_secs(86_400);
//! let charge = |answer: Result<u64, ChargeError>| {
//!     idem.operation("charge", "order-9")
//!         .retain(day)
//!         .fingerprint_none()
//!         // A timeout after the request left: the charge may or may not have happened.
//!         .classify(|_: &ChargeError| Disposition::Unknown)
//!         .run(move || async move { answer })
//! };
//! assert!(charge(Err(ChargeError("provider timed out".into()))).await.is_err());
//! assert!(charge(Ok(1)).await.is_err()); // parked: no retry charges blindly
//!
//! // The reconciler: list the UNKNOWN operations, ask the provider, resolve.
//! let parked = idem.list(&ListFilter::unknown()).await?;
//! let record = &parked[0];
//! let provider_says = serde_json::json!(4_999); // it did charge
//! let resolution = Resolution::Completed { outcome: provider_says, version: 1, retain: day };
//! idem.resolve(&record.id, record.epoch, resolution).await?;
//! assert_eq!(charge(Ok(1)).await.unwrap(), 4_999); // replayed
//! # Ok(()) }
//! ```
//!
//! # Purge
//!
//! Completed records stay until they are purged, whatever their retention (a claim
//! treats an expired one as absent). [`Idem::purge_expired`](crate::Idem::purge_expired)
//! deletes those past their retention and returns how many;
//! [`Idem::spawn_reaper`](crate::Idem::spawn_reaper) does it on a schedule until its
//! handle is dropped. An operation released with its [steps](crate::step) kept expires
//! the same way, its `retain` after the release (or
//! [`RESUME_WINDOW`](crate::store::RESUME_WINDOW) after a `Resolution::Retry`), and is
//! purged with its steps. Records held by a claim, or UNKNOWN, are never purged. Redis
//! expires these records by itself; purging there is optional.
//!
//! # Stuck claims and reconciliation
//!
//! - [`Idem::stats`](crate::Idem::stats): counts by state, and the age of the oldest
//!   IN_PROGRESS and UNKNOWN records, for alerting. Operations released with their
//!   steps kept, waiting for a retry, are counted apart (`released`), not as claims.
//! - [`Idem::list`](crate::Idem::list) with a [`ListFilter`](crate::ListFilter)
//!   ([`unknown()`](crate::ListFilter::unknown), [`stuck(age)`](crate::ListFilter::stuck)):
//!   records oldest first.
//! - [`Idem::get`](crate::Idem::get): one record in full (state, epoch, lease, expiry,
//!   outcome, and the [steps](crate::step) an unfinished operation completed, with their
//!   values, epochs and ages: what happened before it stopped).
//! - [`Idem::resolve`](crate::Idem::resolve) with a [`Resolution`](crate::Resolution):
//!   `Retry` (the effect did not happen: the next call runs the body, replaying the
//!   steps it recorded), `Completed` (it
//!   happened: later calls replay this outcome) or `Rejected` (record this error). A
//!   resolve is fenced by the epoch it names: if another attempt claimed the operation
//!   meanwhile, it is refused with [`IdemError::Fenced`](crate::IdemError::Fenced) and
//!   nothing changes.
//! - [`Idem::forget`](crate::Idem::forget): an operator's undo of a wrong record (a
//!   mistaken `Completed`, say), also fenced by epoch; never a claim whose lease holds.
//!
//! A reconciler finds the downstream effect by the key the body gave the downstream
//! system: [`OperationId::downstream_key`](crate::OperationId::downstream_key) computes,
//! from a listed record, what [`Current::downstream_key`](crate::Current::downstream_key)
//! gave inside the body. The workspace's `examples/reconcile.rs` is a complete
//! reconciler against a payment provider's status lookup.
//!
//! # Metrics and logs
//!
//! With the `metrics` feature idem counts claims, replays, mismatches, in-flight
//! answers, takeovers, fenced finishers, UNKNOWN operations, store errors and purged
//! records, and times bodies, through the `metrics` facade: see
//! [`metrics`](crate::metrics). Alert on UNKNOWN and fenced counts rising, and on
//! [`Stats::oldest_unknown`](crate::Stats::oldest_unknown): each means an effect needs a
//! person or a longer `lease`.
//!
//! `tracing` events carry scope, name and key;
//! [`log_keys_hashed(true)`](crate::IdemBuilder::log_keys_hashed) logs digests instead,
//! and [`hash_keys(secret)`](crate::IdemBuilder::hash_keys) stores them as keyed digests.
//!
//! # The `idem` command
//!
//! The `idem-cli` package installs `idem`, which does the same from a shell on a
//! SQLite, PostgreSQL, MySQL/MariaDB or Redis store. It never creates or migrates a
//! table, so a wrong URL, table name or key prefix is an error rather than an empty
//! store:
//!
//! ```text
//! idem --url postgres://app@db/app stats                     # counts, oldest stuck ages
//! idem --url postgres://app@db/app list --state unknown --older-than 5m --scope acme
//! idem --url postgres://app@db/app show acme charge order-42 # state, epoch, lease, outcome, steps
//! idem --url postgres://app@db/app resolve acme charge order-42 --completed '{"id":7}'
//! idem --url postgres://app@db/app resolve acme charge order-42 --retry --epoch 3
//! idem --url postgres://app@db/app forget acme charge order-42
//! idem --url sqlite://app.db purge
//! idem schema mysql --table payments_idem                    # the DDL, for migrate(false)
//! ```
//!
//! Scopes and keys are given as the application passes them (`--int-key` for integer
//! keys, `--encoded` for values copied from `list`); `--table` names a table set with
//! [`IdemBuilder::table`](crate::IdemBuilder::table), `--secret-env VAR` the variable
//! holding the [`hash_keys`](crate::IdemBuilder::hash_keys) secret, and `--json` prints
//! JSON for scripts. Exit codes: 0 done, 1 the store failed, 2 bad arguments, 3 no such
//! record, 4 resolve or forget refused. `idem --help` lists every command.
