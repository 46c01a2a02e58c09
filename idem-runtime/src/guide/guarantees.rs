//! What idem promises, precisely, and where each promise ends.
//!
//! ```
//! use idem_runtime::{Idem, IdemError, idempotent};
//! use std::sync::atomic::{AtomicU32, Ordering};
//!
//! static RUNS: AtomicU32 = AtomicU32::new(0);
//!
//! #[idempotent(store = idem, key = order, retain = "1d")]
//! async fn ship(idem: &Idem, order: u64) -> Result<u32, IdemError> {
//!     tokio::task::yield_now().await;
//!     Ok(RUNS.fetch_add(1, Ordering::SeqCst) + 1)
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), IdemError> {
//! let idem = Idem::memory();
//! let calls: Vec<_> = (0..20)
//!     .map(|_| {
//!         let idem = idem.clone();
//!         tokio::spawn(async move { ship(&idem, 7).await })
//!     })
//!     .collect();
//! for call in calls {
//!     assert_eq!(call.await.unwrap()?, 1); // every caller gets the one run's outcome
//! }
//! assert_eq!(RUNS.load(Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```
//!
//! # One execution per key among concurrent callers
//!
//! An operation is `(scope, name, key)`. The claim is one atomic step in the store
//! (a conditional insert or upsert, a Lua script on Redis), never a read followed by a
//! write: of N callers with one key, one runs the body. The others wait, woken when it
//! finishes, and get its outcome; or, past their wait (`in_flight = wait("5s")` by
//! default) or with `in_flight = reject`, they get [`IdemError::InFlight`] with the
//! lease's remaining time as `retry_after`. The callers of one process waiting on one
//! key are capped ([`IdemBuilder::max_waiters`](crate::IdemBuilder::max_waiters));
//! past the cap they get [`IdemError::TooManyWaiters`] at once.
//!
//! # Replays
//!
//! A completed outcome is returned to every duplicate for `retain`; the body does not
//! run. [`observe`](crate::observe) tells a replay from a first execution. After
//! `retain` the key is free again and a call runs the body.
//!
//! # Mismatch
//!
//! The request's fingerprint is bound to the key at the first claim and survives
//! retries and takeovers: the same key with another payload is
//! [`IdemError::Mismatch`], whatever the record's state. The new payload never runs
//! and the old outcome is never returned. The fingerprint is SHA-256 over a canonical
//! encoding (typed, length-prefixed, versioned, map and struct entries sorted, and a
//! part of 2 KiB or more in as the BLAKE3 digest of its encoding padded to a multiple
//! of 4 KiB, which BLAKE3 hashes faster),
//! the same across processes and builds; a `serde_json::Value` in the payload
//! fingerprints the same whether or not some crate in the build turned on serde_json's
//! `arbitrary_precision` or `raw_value`. Until 1.0 the encoding may change; its
//! version byte lets a later release read older records.
//!
//! # Errors
//!
//! By default (`errors = release`) an `Err` releases the claim: the record is removed
//! and a retry runs the body again, with any payload. An operation that recorded
//! [steps](crate::step) keeps them, and its payload stays bound for its `retain`,
//! counted from the release: a retry within it replays the completed steps and runs the
//! rest, and another payload is [`IdemError::Mismatch`](crate::IdemError::Mismatch);
//! past it the record expires like a completed one (purged, and any payload runs
//! afresh, steps and all). `errors = record` records the
//! error and replays it like a success. `classify = path` decides per error:
//! [`Disposition::Release`](crate::Disposition::Release),
//! [`Record`](crate::Disposition::Record) or [`Unknown`](crate::Disposition::Unknown),
//! the last parking the operation in UNKNOWN until an operator calls
//! [`Idem::resolve`](crate::Idem::resolve).
//!
//! # Exactly once, and where
//!
//! Inside the store's transaction boundary the effect is exactly once: in
//! [transactional mode](super::transactions) the body's own writes commit with the
//! claim and the record, or not at all. Outside it (a payment provider, an email API)
//! idem runs the body once per key except after a crash or a lapsed lease, where the
//! body runs again at a higher epoch. For those effects, pass
//! [`current()`](crate::current)`.`[`downstream_key("label")`](crate::Current::downstream_key)
//! (the same across retries and takeovers) to the downstream system as its idempotency
//! key, or use `on_takeover = unknown` to stop and reconcile instead of running again.
//! A body of several effects makes each a [`step`](crate::step): a crash then repeats
//! at most the step it crashed in, not the steps recorded before it.
//!
//! # Crashes, leases and epochs
//!
//! A body that crashes, panics or is cancelled keeps its claim until its lease lapses
//! (`lease = "60s"` by default), by the store's clock, never the application
//! server's. While the call's future is alive, the lease is renewed in the background,
//! so a slow body is not taken over; a body that may await forever should have a
//! timeout. One task per [`Idem`](crate::Idem) renews every live claim from a schedule
//! ordered by due time; a call made on another runtime renews on that runtime, so no
//! renewal waits on a runtime nobody drives.
//!
//! When the lease lapses, the next caller takes the claim over and runs the body again
//! (`on_takeover = rerun`), or the operation goes to UNKNOWN (`on_takeover =
//! unknown`). The late finisher's record, release or renewal is refused with
//! [`IdemError::Fenced`]: its outcome is not written. An epoch identifies one claim for
//! all time. Every claim takes a new one from a counter of the store's (a PostgreSQL
//! sequence, a SQLite row, a MySQL `AUTO_INCREMENT` table) or, on Redis, from the
//! server's clock in microseconds, so no late finisher or renewal can act on a newer
//! claim, whatever was released, resolved or purged in between. Epochs are unique,
//! increasing numbers, not attempt counts.
//!
//! A claim whose body never started (the caller went away while the claim was being
//! made) is released, even if the store answers only after the caller left, as long as
//! it answers within the store timeout of the claim's sending: nothing ran, so it must
//! not end in UNKNOWN. A claim the store made but never answered within that timeout
//! has an epoch nobody learned, so it cannot be released: it lapses with its lease.
//!
//! [`Idem::memory`](crate::Idem::memory) renews nothing: its store lives in the call's
//! own process, so it holds a running call's claim for as long as the call's future
//! lives (a runtime stalled for many leases cannot lose it), and a call cancelled or
//! panicked leaves a lease that runs from that moment.
//!
//! # A body that ran, an outcome not recorded
//!
//! If the store is down when the outcome is to be recorded, the record is retried
//! while the lease may hold (renewals keep running; at most one lease of retries), then
//! the call ends with [`IdemError::Unrecorded`], distinct from [`IdemError::Store`]
//! (where the body did not run). The claim stays IN_PROGRESS, so nothing runs again
//! before the lease lapses. A renewal that finds the claim gone ends the retries with
//! `Fenced`.
//!
//! # Network faults
//!
//! No call waits on a store without a bound.
//! [`IdemBuilder::store_timeout`](crate::IdemBuilder::store_timeout) (5 s by default)
//! bounds every statement; the record's retries together are bounded by the lease, and
//! so are a move to UNKNOWN's. A statement that timed out has its connection closed at
//! once, so a connection gone silent is replaced by the next call's. The whole table is
//! in the [`store`](crate::store) module's "Network faults" section.
//!
//! # When the store is unreachable
//!
//! With `on_store_error = fail_closed` (the default) a call whose claim cannot reach
//! the store returns [`IdemError::Store`] and the body does not run. `fail_open` runs the
//! body unprotected, with a warning event, only when the store is *unreachable*: a
//! connection-level failure, a pool timeout, PostgreSQL SQLSTATE classes 08 and 57P,
//! their MySQL and Redis counterparts. A refusal (a constraint, an invalid key),
//! contention, a read-only server or a serialization conflict fails closed, and so does
//! a claim that got no answer within the store timeout (silence cannot be told from a
//! lock wait) and any error once the store has said another call holds the claim. A caller waiting on
//! an in-flight call rides out transient store errors until its wait ends.
//!
//! # The operation's identity
//!
//! The default operation name is the function's name. Two functions that default to
//! one name (`stripe::refund` and `paypal::refund`) would share records, so both are
//! refused: their calls return [`IdemError::Config`] naming both functions, whichever is
//! called first. `name = "..."` states the name; it keeps an operation's identity when
//! the function is renamed or moved, and lets two functions share records on purpose.
//!
//! The builder is as explicit as the attribute: [`Operation::run`](crate::Operation::run)
//! does not compile until the retention ([`retain`](crate::Operation::retain)) and the
//! fingerprint ([`fingerprint`](crate::Operation::fingerprint), or
//! [`fingerprint_none`](crate::Operation::fingerprint_none) where the key alone is the
//! whole request) are stated.
//!
//! ```compile_fail
//! # async fn f(idem: idem_runtime::Idem) {
//! // No retention and no fingerprint stated: `run` is not available.
//! let _ = idem
//!     .operation("charge", "order-1")
//!     .run(|| async { Ok::<_, idem_runtime::IdemError>(()) })
//!     .await;
//! # }
//! ```
//!
//! A key that is empty, or has an empty text part (`""`, `(tenant, "")`), is refused
//! with [`IdemError::EmptyKey`] before anything is written: an empty identifier is
//! almost always a missing one. The scope may be empty; it is the default namespace.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use idem_runtime::{Idem, IdemError};
//! let idem = Idem::memory();
//! let out = idem
//!     .operation("charge", &("acme", ""))
//!     .retain(std::time::Duration::from_secs(60))
//!     .fingerprint_none()
//!     .run(|| async { Ok::<_, IdemError>(()) })
//!     .await;
//! assert!(matches!(out, Err(IdemError::EmptyKey { .. })));
//! # }
//! ```
//!
//! # Replays are not authorization
//!
//! A replay returns what the first call returned. Authorize before the call as for a
//! first call, and put the principal in `scope`, so a key reused by another principal
//! is another operation rather than someone else's outcome.
//!
//! # Bounds
//!
//! Encoded keys and scopes are capped at 255 bytes ([`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES)),
//! outcomes at 64 KiB ([`IdemBuilder::max_outcome_bytes`](crate::IdemBuilder::max_outcome_bytes),
//! an operator's `resolve` included); over a cap is an error, never a truncation. An
//! outcome over the cap moves the operation to UNKNOWN: the body ran, so it is not
//! released to run again. In [transactional mode](crate::guide::transactions) the
//! body's writes are rolled back with its claim instead, so nothing happened and a retry
//! runs afresh; [`IdemError::OutcomeTooLarge`](crate::IdemError::OutcomeTooLarge) says
//! which with `in_doubt`. `lease` and in-flight waits are capped at 366 days
//! ([`MAX_LEASE_OR_WAIT`](crate::MAX_LEASE_OR_WAIT)) and refused before anything is
//! written. The store keeps the outcome only, never the request. PostgreSQL `TEXT`
//! cannot hold a NUL character, so there a key or scope containing `\0` is refused by
//! the database (a refusal: even `fail_open` does not run the body);
//! [`hash_keys`](crate::IdemBuilder::hash_keys) avoids it.
//!
//! # The memory store
//!
//! [`Idem::memory`](crate::Idem::memory) keeps records in the process: it deduplicates
//! within one process and forgets everything when the process exits. Use SQLite (one
//! host) or a database server (many hosts) for anything that must survive a restart.
//!
//! # How the promises are tested
//!
//! Beside one conformance suite run against every store, a seeded model-based test and
//! the concurrency tests, the workspace's tests inflict real faults on PostgreSQL, with
//! a payment provider served over HTTP on 127.0.0.1 that deduplicates by the key it is
//! given and counts effects, and worker processes:
//!
//! | fault | what the test checks |
//! |---|---|
//! | `kill -9` of a worker before the provider call, after it, and after the body returned but before the record | a second process waits out the lease, takes over at a higher epoch and calls the provider with the same downstream key: one effect per key |
//! | `SIGSTOP` past the lease, another process completes, then `SIGCONT` | the frozen process gets `Fenced`; the record is the taker's; one effect |
//! | `kill -9` with `on_takeover = unknown` | the retry gets `Unknown`; a reconciler asks the provider and resolves; the next call replays or runs afresh |
//! | the PostgreSQL server crashed (`-m immediate`) in the middle of 1,000 keyed calls | callers see `Store` or `Unrecorded`, never a panic or a hang; after the restart every key has one completed record and one effect; while it is down `fail_closed` never runs a body and `fail_open` does, with a warning |
//! | a claim answered after its lease lapsed and was taken over | its body never runs: a claim older than half its lease is confirmed before the body starts |
//!
//! [`IdemError::Config`]: crate::IdemError::Config
//! [`IdemError::EmptyKey`]: crate::IdemError::EmptyKey
//! [`IdemError::Fenced`]: crate::IdemError::Fenced
//! [`IdemError::InFlight`]: crate::IdemError::InFlight
//! [`IdemError::Mismatch`]: crate::IdemError::Mismatch
//! [`IdemError::Store`]: crate::IdemError::Store
//! [`IdemError::TooManyWaiters`]: crate::IdemError::TooManyWaiters
//! [`IdemError::Unrecorded`]: crate::IdemError::Unrecorded
