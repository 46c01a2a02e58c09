//! The store on Redis or Valkey, standalone or Redis Cluster (feature `redis`).
//!
//! ```no_run
//! use idem_runtime::{Idem, IdemError};
//!
//! # async fn open() -> Result<(), IdemError> {
//! let idem = Idem::redis("redis://127.0.0.1:6379").await?; // keys under `idem:`
//! let billing = Idem::builder()
//!     .key_prefix("billing")
//!     .redis_cluster(&["redis://node-1:6379", "redis://node-2:6379"])
//!     .await?;
//! # let _ = (idem, billing); Ok(()) }
//! ```
//!
//! Every state change is one Lua script (`idem-runtime/lua/*.lua`), so the claim's
//! decision (fresh, replay, in flight, mismatch, takeover, or UNKNOWN under
//! [`Takeover::Unknown`]) is one round trip and one atomic
//! step on the server; every write after a claim is fenced on its epoch inside the
//! script. Leases, retention and ages use the server's clock (`TIME`).
//!
//! # Keys
//!
//! An operation `(scope, name, key)` lives in two keys sharing one hash tag, the first
//! 128 bits of a SHA-256 of the three parts, so every script touches one slot in Redis
//! Cluster:
//!
//! - `<prefix>:r:{<tag>}`, a hash: state, epoch, fingerprint, the operation, the
//!   lease, and for a completed record its outcome (one field, `is_err:version:body`)
//!   and retention deadline (`idem-runtime/lua/prelude.lua` lists the fields). A fresh
//!   claim writes its lease's length alone: its epoch is the server's clock in µs, so
//!   the claim time and the lease deadline follow from the two, and the script converts
//!   and formats no number. A renewal or a later claim of the record writes both. On
//!   a standalone server that fresh epoch is also a sample of the server's clock (see
//!   `clock.rs`): the record sent within a second of a sample no older than its claim is
//!   handed its retention deadline (the least the server's clock can read by then,
//!   plus `retain`) and its TTL, so its script reads no `TIME` and formats no number
//!   either; otherwise, and on a cluster, the script reads `TIME`. A
//!   completed record gets `PEXPIRE` five minutes past its retention: claims treat it
//!   as absent from its retention on, [`Admin::purge_expired`] deletes (and counts) the
//!   ones it finds early, and Redis drops the rest by itself, so nothing needs to run a
//!   purge.
//! - `<prefix>:s:{<tag>}`, the operation's [steps](Store::record_step), a hash from
//!   label to `seq:epoch:recorded-at:is_err:version:body` (`seq` numbers the labels
//!   in the order first recorded, so [`Store::steps`] lists them oldest first; a label
//!   recorded again keeps its `seq`). It exists only while its record is in progress or
//!   unknown, and goes in the script that completes, removes or forgets the record, or
//!   that claims or purges it once it expired.
//!
//! Steps belong to one life of the record, which the record's field `st` tracks:
//! absent, no steps in this life (the steps key, if any, is an earlier life's, and the
//! first step recorded deletes it); `1`, the steps key is this life's; `2`, the claim
//! was released with its steps (a release, or an operator's retry): the record stays
//! in progress with its fingerprint and a lapsed lease, its epoch no longer holds, and
//! the next claim with the same fingerprint resumes it at once, until it expires
//! (`xa`, the operation's retention from the release): then it is expired as a
//! completed record is, and it and its steps key get the same `PEXPIRE` five minutes
//! later. A fresh claim, or a
//! claim that replaces an expired record, writes a hash without `st`. An operation that
//! records no steps pays for them with one more field read in its scripts.
//!
//! Beside them, `<prefix>:m:{key-mode}` records how the prefix stores keys and scopes
//! (as given, or keyed-hashed under [`hash_keys`](crate::IdemBuilder::hash_keys) with
//! a check value of the secret). [`IdemBuilder::redis`](crate::IdemBuilder::redis)
//! writes it at the first open (`SET … NX`) and refuses an open in another mode, as the
//! SQL stores do with their table: the other mode would give every operation another
//! identity and run its body again. Its own hash tag keeps it one key on one slot.
//!
//! # Why epochs never repeat
//!
//! An epoch is the server's clock (`TIME`) in microseconds when the claim ran, or the
//! record's epoch plus one if that is higher: a new record takes the clock, and a
//! takeover or a resume takes the larger of the clock and the epoch it replaces. Two
//! claims of one operation are at least a round trip apart (the second needs the
//! first's reply, then a release or a lapsed lease), so each claim's epoch is its own
//! microsecond, later than every earlier claim's. A release or a purge that deletes the
//! record therefore needs no tombstone: the next claim's clock is past every epoch the
//! operation ever had, and a stalled claimant's late write stays fenced. Within one
//! life of the record epochs only grow, whatever the clock does. The one way to see an
//! epoch again is the server's clock stepping back (or a failover to a server whose
//! clock is behind) onto the exact microsecond of an earlier claim of the same
//! operation, deleted since, whose claimant is still running.
//!
//! # Waiters
//!
//! A caller about to wait on an in-flight operation flags its record; finishing a
//! flagged record (record, release, UNKNOWN, resolve) publishes the operation on
//! `<prefix>:wake` in the same script, and each `Idem` subscribes to that channel and
//! wakes its waiters at once. Unflagged records publish nothing. A wake-up lost to a
//! dropped subscription costs one poll interval.
//!
//! # Replays
//!
//! After replays were seen lately (see [`Store::peek_completed`]; each replay raises a
//! score by 8, up to 64, each fresh claim lowers it by 1), a replay is first tried as
//! plain commands in one pipelined round trip, far lighter for the server than a
//! script; what that read does not answer goes on to the claim script. On a standalone
//! server the read is `HMGET` of the record's retention deadline, fingerprint and
//! outcome (a record has an outcome only once COMPLETED), and `TIME` when no sample of
//! the server's clock (a `TIME`, or a fresh claim's epoch) came in the last second: a
//! record whose retention ends after the server's clock answers
//! the replay or the mismatch. With `TIME` in the same round trip, after the record, the
//! clock is that `TIME`; without it, the most the server's clock can read by then,
//! bounded by the last `TIME` and this process's monotonic clock since it was sent
//! (`clock.rs`: a server clock stepped forward within that second can let a record
//! replay up to the step past its retention, never run its body twice). On a cluster, where `TIME` could
//! reach another node's clock, the record's own TTL stands in for the clock: `HMGET`,
//! `PTTL`, `HMGET` on the record's node, answering only when the TTL is above the five
//! minutes a record is kept past its retention and the two reads agree on state, epoch
//! and deadline.
//!
//! # Listing and stats
//!
//! [`Admin::stats`], [`Admin::list`] and [`Admin::purge_expired`] walk the record keys
//! with `SCAN … MATCH <prefix>:r:*` (never `KEYS`), on every master in a cluster: an
//! index (a sorted set per state) would be one more key on another slot, which a
//! cluster script cannot touch together with the record. They cost a pass over the
//! store's keys and are meant for operators and alerting, not for request paths.
//!
//! # No transactional mode
//!
//! Transactional mode ([`Operation::begin_tx`](crate::Operation::begin_tx)) commits the
//! outcome in the same transaction as the caller's own writes. Redis cannot join that
//! transaction: the caller's data lives in another database, and `MULTI` neither spans
//! databases nor rolls back. So transactional mode needs a SQL store; on Redis an
//! operation runs leased, with the claim, the body and the record as separate steps.
//!
//! # Durability
//!
//! The store is as durable as the server is configured to be: with persistence off, a
//! restart forgets completed records and a retry runs its body again; with AOF and
//! `appendfsync everysec`, up to a second of records can be lost; with `appendfsync
//! always` a recorded outcome survives a crash as it does in PostgreSQL. A replica
//! promoted after a failover may miss the last writes (replication is asynchronous,
//! and idem does not issue `WAIT`).
//!
//! # Connections
//!
//! One store (and every clone of its `Idem`) holds, on a standalone server, 3
//! connections: two multiplexed connections for commands (each reconnects by itself
//! after a drop) and one subscribed to the wake-up channel. Scripts take the two in
//! turn, so the server runs one connection's scripts while the client writes the
//! other's; the replay read and other light commands stay on the first, where they
//! gather into fewer writes. On a cluster it holds one
//! multiplexed connection per node, the subscription to the first node, and, while
//! [`Admin::stats`], [`Admin::list`] or [`Admin::purge_expired`] runs, one more per
//! master. The builder's `max_connections` does not apply: commands share their
//! connection rather than wait for one.
//!
//! # Errors
//!
//! A server that cannot be reached is a retryable, unreachable
//! [`IdemError::Store`](crate::IdemError::Store), the only kind
//! [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) acts on.
//!
//! # A read-only server
//!
//! A replica refuses the scripts' writes with `READONLY` (a URL naming a replica, or a
//! primary demoted in a failover until the client follows the new one). That is a
//! retryable store error, never an unreachable one: the body does not run, and
//! `fail_open` does not run it unprotected either (the server answered and holds the
//! records); a record is retried while its lease holds.

mod clock;
mod conn;
mod keys;
mod scan;
mod scripts;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use ::redis::Value;

use self::clock::ServerClock;
use self::conn::{Conn, Lane, relay_wakeups, store_error};
use self::scripts::{GRACE_MS, Scripts};
use self::wire::{PackedStep, bytes, int, ms, ms_count, packed, protocol, text, unpacked};
use super::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail,
    RecordInfo, ReplayGate, State, Stats, StepRecord, Store, StoreFuture, StoredOutcome, Takeover,
    WakeHub,
};
use crate::error::StoreError;

/// The key prefix when none is set.
pub const DEFAULT_PREFIX: &str = "idem";

/// The store on Redis or Valkey; see the [module docs](self).
///
/// Opened by [`Idem::redis`](crate::Idem::redis) and
/// [`IdemBuilder::redis`](crate::IdemBuilder::redis), or by [`RedisStore::connect`]
/// for use with [`IdemBuilder::store`](crate::IdemBuilder::store).
pub struct RedisStore {
    conn: Conn,
    prefix: String,
    scripts: Scripts,
    /// Where the wake-up subscription connects (a standalone server, or a cluster's
    /// first node: `PUBLISH` reaches every node of a cluster).
    pubsub: ::redis::Client,
    /// The task relaying wake-ups to this process's waiters, ended with the store.
    listener: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
    /// Whether replays came in lately, so a replay is worth reading before the claim.
    gate: ReplayGate,
    /// A recent `TIME`, so a standalone server's replay read can leave it out.
    clock: ServerClock,
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        let listener = self.listener.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(task) = listener.take() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("cluster", &matches!(self.conn, Conn::Cluster { .. }))
            .finish()
    }
}

impl RedisStore {
    /// The store on `conn`, keeping records under `prefix` (which the caller checked), its
    /// wake-ups subscribed through `pubsub`.
    fn new(conn: Conn, prefix: &str, pubsub: ::redis::Client) -> RedisStore {
        RedisStore {
            conn,
            prefix: prefix.to_owned(),
            scripts: Scripts::new(),
            pubsub,
            listener: Default::default(),
            gate: ReplayGate::default(),
            clock: ServerClock::new(),
        }
    }
}

impl Store for RedisStore {
    /// While replays come in, a pipeline of plain commands instead of the claim's script:
    /// far less work for the server. It answers only for a COMPLETED record it knows was
    /// within its retention when read; anything else goes on to the claim.
    ///
    /// - Standalone: `HMGET`, then `TIME`. Not atomic, and it need not be: `TIME` runs
    ///   after the read, so a retention deadline past that time was not reached when the
    ///   record was read.
    /// - Cluster: `TIME` could reach another node and its clock, so the record's own TTL
    ///   stands in for it: `HMGET`, `PTTL`, `HMGET` on the record's node. A completed
    ///   record's TTL ends `GRACE_MS` after its retention, so a TTL above that (by a
    ///   millisecond's rounding) means the retention had not ended; the two reads agreeing
    ///   on state, epoch and deadline mean the TTL was that record's (a new claim always
    ///   takes a new epoch).
    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        StoreFuture::new(async move {
            if !self.gate.open() {
                return Ok(None);
            }
            let (rec, ..) = self.keys(id);
            // `fp` and `o` of a record completed and within its retention, else `None`.
            // A record has `o` only once completed (`finish` writes it with `s` = 1, and
            // nothing moves a completed record out of that state), so the standalone
            // read takes the three fields it needs: each value of a reply costs the
            // client a parse, and the client is what bounds many callers' replays.
            let completed = match &self.conn {
                Conn::Single(conn) => {
                    let mut hmget = ::redis::cmd("HMGET");
                    hmget.arg(&rec).arg(&["xa", "fp", "o"]);
                    let (fields, now) = if self.clock.fresh() {
                        let fields: Vec<Value> = conn
                            .run(Lane::Light, async |c| hmget.query_async(c).await)
                            .await
                            .map_err(store_error)?;
                        // Bounded once the reply is in: the read ran before.
                        (fields, self.clock.latest_ms())
                    } else {
                        // `TIME` after the record: a record alive at that `TIME` was
                        // alive when read.
                        let mut pipe = ::redis::pipe();
                        pipe.add_command(hmget).cmd("TIME");
                        let sent = self.clock.local_us();
                        let (fields, (secs, micros)): (Vec<Value>, (i64, i64)) = conn
                            .run(Lane::Light, async |c| pipe.query_async(c).await)
                            .await
                            .map_err(store_error)?;
                        let got = self.clock.local_us();
                        self.clock.note(sent, got, secs * 1_000_000 + micros);
                        (fields, Some(secs * 1000 + micros / 1000))
                    };
                    let [xa, fp, outcome] = <[Value; 3]>::try_from(fields)
                        .map_err(|f| protocol(format!("HMGET answered {f:?}")))?;
                    let alive = now.is_some_and(|now| int(&xa).is_some_and(|xa| xa > now));
                    (alive && outcome != Value::Nil).then_some((fp, outcome))
                }
                Conn::Cluster { conn, .. } => {
                    let read = ["s", "xa", "e", "fp", "o"];
                    let (fields, ttl, again): (Vec<Value>, i64, Vec<Value>) = ::redis::pipe()
                        .cmd("HMGET")
                        .arg(&rec)
                        .arg(&read)
                        .cmd("PTTL")
                        .arg(&rec)
                        .cmd("HMGET")
                        .arg(&rec)
                        .arg(&read[..3])
                        .query_async(&mut conn.clone())
                        .await
                        .map_err(store_error)?;
                    let alive = fields.get(..3) == Some(&again[..]) && ttl > GRACE_MS + 1;
                    let [state, _, _, fp, outcome] = <[Value; 5]>::try_from(fields)
                        .map_err(|f| protocol(format!("HMGET answered {f:?}")))?;
                    (alive && int(&state) == Some(1)).then_some((fp, outcome))
                }
            };
            let Some((fp, outcome)) = completed else {
                return Ok(None);
            };
            self.gate.saw(true);
            if bytes(&fp).as_deref() != Some(&fingerprint[..]) {
                return Ok(Some(Err(Mismatched)));
            }
            unpacked(&outcome).map(|o| Some(Ok(o)))
        })
    }

    fn claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
    ) -> StoreFuture<'a, Result<Claim, StoreError>> {
        StoreFuture::new(async move {
            let mode: &[u8] = match req.on_takeover {
                Takeover::Rerun => b"rerun",
                Takeover::Unknown => b"unknown",
            };
            let lease = ms(super::lease_written(req.lease));
            let (scope, name) = (&req.id.scope, &req.id.name);
            let scope_name = format!("{}:{scope}{}:{name}", scope.len(), name.len());
            let sent = self.clock.local_us();
            let v = self
                .run(
                    &self.scripts.claim,
                    req.id,
                    &[
                        &req.fingerprint,
                        lease.as_bytes(),
                        mode,
                        scope_name.as_bytes(),
                        req.id.key.as_bytes(),
                    ],
                )
                .await?;
            let bad = || protocol(format!("claim answered {v:?}"));
            // A fresh claim answers its epoch alone, in decimal.
            if let Value::BulkString(_) = &v {
                self.gate.saw(false);
                let epoch = int(&v).ok_or_else(bad)?;
                // That epoch is the server's `TIME` in µs when the claim ran: a sample of
                // its clock, which spares the record's script its own `TIME`.
                if let Conn::Single(_) = &self.conn {
                    self.clock.note(sent, self.clock.local_us(), epoch);
                }
                return Ok(Claim::Acquired {
                    epoch: u64::try_from(epoch).map_err(|_| bad())?,
                    takeover: false,
                    resume: false,
                });
            }
            let Value::Array(parts) = &v else {
                return Err(bad());
            };
            let tag = parts.first().and_then(text).ok_or_else(bad)?;
            let n = |i: usize| parts.get(i).and_then(int).ok_or_else(bad);
            let claim = match tag.as_str() {
                "acquired" => Claim::Acquired {
                    epoch: n(1)? as u64,
                    takeover: n(2)? == 1,
                    resume: n(3)? == 1,
                },
                "completed" => Claim::Completed(unpacked(parts.get(1).ok_or_else(bad)?)?),
                "inflight" => Claim::InFlight {
                    retry_after: Duration::from_millis(n(1)?.max(0) as u64),
                },
                "mismatch" => Claim::Mismatch,
                "unknown" => Claim::Unknown {
                    epoch: n(1)? as u64,
                    now: n(2)? == 1,
                },
                _ => return Err(bad()),
            };
            self.gate
                .saw(matches!(claim, Claim::Completed(_) | Claim::Mismatch));
            Ok(claim)
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let retain_ms = ms_count(retain);
            // On a standalone server whose clock a sample taken since the claim bounds,
            // the script is handed the retention deadline (the least the server's clock
            // reads now, plus `retain`) and the record's TTL: it reads no `TIME` and
            // formats no number. That deadline is never past the server's clock at the
            // write plus `retain`, and never before its clock at the claim's send plus
            // `retain`, where the replay cache's entry starts (see `clock.rs`).
            let given = match &self.conn {
                Conn::Single(_) => i64::try_from(epoch)
                    .ok()
                    .and_then(|since| self.clock.least_ms(since))
                    .map(|now| {
                        let ttl = retain_ms.saturating_add(GRACE_MS);
                        (now.saturating_add(retain_ms).to_string(), ttl.to_string())
                    }),
                Conn::Cluster { .. } => None,
            };
            let (epoch, retain) = (epoch.to_string(), retain_ms.to_string());
            let outcome = packed(outcome);
            let (e, o, r) = (epoch.as_bytes(), &outcome[..], retain.as_bytes());
            let args: &[&[u8]] = match &given {
                Some((xa, ttl)) => &[e, o, r, xa.as_bytes(), ttl.as_bytes()],
                None => &[e, o, r],
            };
            self.fenced(&self.scripts.record, id, args).await
        })
    }

    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let (epoch, retain) = (epoch.to_string(), ms(retain));
            self.fenced(
                &self.scripts.release,
                id,
                &[epoch.as_bytes(), retain.as_bytes()],
            )
            .await
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let epoch = epoch.to_string();
            self.fenced(&self.scripts.mark_unknown, id, &[epoch.as_bytes()])
                .await
        })
    }

    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let (epoch, lease) = (epoch.to_string(), ms(super::lease_written(lease)));
            self.fenced(
                &self.scripts.renew,
                id,
                &[epoch.as_bytes(), lease.as_bytes()],
            )
            .await
        })
    }

    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let epoch = epoch.to_string();
            self.fenced(
                &self.scripts.record_step,
                id,
                &[epoch.as_bytes(), label.as_bytes(), &packed(outcome)],
            )
            .await
        })
    }

    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        StoreFuture::new(async move {
            let v = self.run(&self.scripts.steps, id, &[]).await?;
            let bad = || protocol(format!("steps answered {v:?}"));
            let Value::Array(parts) = &v else {
                return Err(bad());
            };
            let (Some(now), pairs) = (parts.first().and_then(int), parts.get(1..).unwrap_or(&[]))
            else {
                return Err(bad());
            };
            if pairs.len() % 2 != 0 {
                return Err(bad());
            }
            let mut steps = Vec::with_capacity(pairs.len() / 2);
            for pair in pairs.chunks_exact(2) {
                let label = text(&pair[0]).ok_or_else(bad)?;
                let packed = bytes(&pair[1]).ok_or_else(bad)?;
                let step = PackedStep::parse(&packed)
                    .ok_or_else(|| protocol(format!("step {label:?} is stored as {packed:?}")))?;
                steps.push((step.seq, step.record(label, now)));
            }
            steps.sort_by_key(|(seq, _)| *seq);
            Ok(steps.into_iter().map(|(_, step)| step).collect())
        })
    }

    fn announce_wait<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<(), StoreError>> {
        StoreFuture::new(async move { self.run(&self.scripts.announce, id, &[]).await.map(drop) })
    }

    fn read_before_claims(&self) {
        self.gate.hold_open();
    }

    fn shares_claim_counts(&self) -> bool {
        true
    }

    fn take_claim_token<'a>(
        &'a self,
        key: &'a str,
        burst: u32,
        every: Duration,
    ) -> StoreFuture<'a, Result<Option<Duration>, StoreError>> {
        // Whole microseconds, at least one: the count's unit.
        let every_us = u64::try_from(every.as_micros()).unwrap_or(u64::MAX).max(1);
        let window_us = every_us.saturating_mul(u64::from(burst));
        StoreFuture::new(async move {
            let mut inv = self.scripts.claim_limit.prepare_invoke();
            inv.key(format!("{}:l:{{{key}}}", self.prefix))
                .arg(every_us.to_string())
                .arg(window_us.to_string());
            let v = self.invoke(&inv).await?;
            match wire::int(&v) {
                Some(0) => Ok(None),
                Some(us) if us > 0 => Ok(Some(Duration::from_micros(us.unsigned_abs()))),
                _ => Err(wire::protocol(format!("the claim limit answered {v:?}"))),
            }
        })
    }

    fn attach_wakers(&self, hub: Arc<WakeHub>) {
        // Without a runtime here there is no task to relay wake-ups; waiters then poll.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let channel = format!("{}:wake", self.prefix);
        let task = rt.spawn(relay_wakeups(self.pubsub.clone(), channel, hub));
        let mut listener = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = listener.replace(task.abort_handle()) {
            old.abort();
        }
    }
}

#[async_trait::async_trait]
impl Admin for RedisStore {
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        let epoch = epoch.to_string();
        match completed {
            None => {
                let window = ms(super::RESUME_WINDOW);
                self.fenced(
                    &self.scripts.resolve,
                    id,
                    &[epoch.as_bytes(), b"retry", b"", window.as_bytes()],
                )
                .await
            }
            Some((outcome, retain)) => {
                let retain = ms(retain);
                self.fenced(
                    &self.scripts.resolve,
                    id,
                    &[
                        epoch.as_bytes(),
                        b"complete",
                        &packed(outcome),
                        retain.as_bytes(),
                    ],
                )
                .await
            }
        }
    }

    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        let epoch = epoch.to_string();
        self.fenced(&self.scripts.forget, id, &[epoch.as_bytes()])
            .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut purged = 0;
        for (now, row) in self.scan().await? {
            let ends = row.state == State::Completed || row.released;
            if ends && row.expires_at.is_some_and(|xa| xa <= now) {
                // The script checks again: the record may have been claimed afresh since.
                // A released record's steps go with it.
                let mut inv = self.scripts.purge.prepare_invoke();
                inv.key(&row.key[..]).key(self.steps_key_of(&row.key));
                if int(&self.invoke(&inv).await?) == Some(1) {
                    purged += 1;
                }
            }
        }
        Ok(purged)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut s = Stats::default();
        for (now, row) in self.scan().await? {
            let age = row.age(now);
            s.count(row.state, row.released, age);
        }
        Ok(s)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let mut rows: Vec<RecordInfo> = self
            .scan()
            .await?
            .into_iter()
            .filter(|(now, r)| {
                filter.state.is_none_or(|s| s == r.state)
                    && filter.name.as_deref().is_none_or(|n| n == r.id.name)
                    && filter.scope.as_deref().is_none_or(|s| s == r.id.scope)
                    && filter.older_than.is_none_or(|a| r.age(*now) > a)
                    && filter.newer_than.is_none_or(|a| r.age(*now) <= a)
            })
            .map(|(now, r)| RecordInfo {
                age: r.age(now),
                id: r.id,
                state: r.state,
                epoch: r.epoch,
            })
            .collect();
        super::sort_listed(&mut rows, filter);
        Ok(rows)
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let r = self.read(id).await?;
        if !r.exists() {
            return Ok(None);
        }
        let bad = || protocol("a record without state, epoch or claim time".into());
        let state = r.state().ok_or_else(bad)?;
        let since = |t: Option<u64>| Duration::from_millis(t.unwrap_or(0).saturating_sub(r.now));
        Ok(Some(RecordDetail {
            info: RecordInfo {
                id: id.clone(),
                state,
                epoch: r.num(1).ok_or_else(bad)?,
                age: Duration::from_millis(r.now.saturating_sub(r.num(3).ok_or_else(bad)?)),
            },
            lease_remaining: (state == State::InProgress).then(|| since(r.num(2))),
            // Of the records in progress, only one released with its steps has `xa`.
            expires_in: match state {
                State::Completed => Some(since(r.num(4))),
                State::InProgress => r.num(4).map(|xa| since(Some(xa))),
                _ => None,
            },
            outcome: if state == State::Completed {
                r.outcome()
            } else {
                None
            },
            steps: Vec::new(),
        }))
    }
}
