//! The leased state machine: claim, wait, execute with a renewed lease, record.

use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::bounded::{bounded, no_answer};
use crate::cache::Cached;
use crate::context;
use crate::error::{IdemError, StoreError};
use crate::idem::Idem;
use crate::lease::Lease;
use crate::limit::Limited;
use crate::metrics;
use crate::op::{Encoded, ErrorPolicy, InFlight, OnStoreError, Operation, Upgrade};
use crate::step_state::StepsMode;
use crate::store::{Claim, ClaimRequest, Fence, StoredOutcome};

mod sent;
use sent::{Armed, ClaimInFlight, Unstarted};

impl<P, U, FP, R> Operation<P, U, FP, R> {
    /// Claims the operation, runs `body` if this call owns it, and records the outcome.
    ///
    /// A completed duplicate gets the recorded outcome without running `body`. See the
    /// crate docs for every other case. The fingerprint and the retention must have been
    /// stated ([`fingerprint`](Self::fingerprint) or
    /// [`fingerprint_none`](Self::fingerprint_none), and [`retain`](Self::retain)); a
    /// call that leaves either out does not compile.
    ///
    /// The returned future is the same size whatever `body` holds: the body's future is
    /// boxed when the body runs, so a replay never makes room for it.
    ///
    /// ```
    /// use idem_runtime::{Idem, IdemError};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let charge = |cents: u64| {
    ///     idem.operation("charge", "order-7")
    ///         .fingerprint(&cents)
    ///         .retain(Duration::from_secs(3600))
    ///         .run(move || async move { Ok::<_, IdemError>(format!("charged {cents}")) })
    /// };
    /// assert_eq!(charge(500).await?, "charged 500");
    /// assert_eq!(charge(500).await?, "charged 500"); // replayed: the body did not run
    /// assert!(matches!(charge(900).await, Err(IdemError::Mismatch { .. })));
    /// # Ok(()) }
    /// ```
    pub fn run<F, Fut, T, E>(self, body: F) -> impl Future<Output = Result<T, E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: crate::op::RecordableOutcome,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
        U: Upgrade<T>,
        FP: crate::op::FingerprintStated,
        R: crate::op::RetentionStated,
    {
        // A block rather than an `async fn`, whose future would hold the operation twice
        // (as its argument and as the local it is moved into).
        let mut op = self.stated();
        async move {
            op.take_invalid()?;
            let run = Run {
                idem: op.idem_handle()?,
                op: &op,
                fingerprint: op.fingerprint_bytes(),
                _t: PhantomData,
            };
            run.go(body).await
        }
    }
}

struct Run<'a, P, U, T> {
    idem: Idem,
    op: &'a Operation<P, U>,
    fingerprint: [u8; 32],
    _t: PhantomData<fn() -> T>,
}

/// When a claim was sent (or, by a store that answers at once, made), whether it was
/// made on this thread just now, so it needs no confirming before the body runs, and
/// whether it resumes recorded steps.
#[derive(Clone, Copy)]
struct At {
    sent: Instant,
    at_once: bool,
    resume: bool,
}

/// What a claim's answer leaves to do.
enum Settled {
    Decided(Decided),
    /// Another call runs the operation, for this long yet at most.
    InFlight(Duration),
}

enum Decided {
    /// Run the body at this epoch, claimed then.
    Execute(u64, At),
    Replay(StoredOutcome),
    Unprotected,
}

impl<'a, P, U, T> Run<'a, P, U, T>
where
    T: Serialize + DeserializeOwned,
    U: Upgrade<T>,
{
    fn name(&self) -> &str {
        &self.op.id.name
    }

    /// A block, not an `async fn`, for the reason `run` gives.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn holds its arguments twice"
    )]
    fn go<F, Fut, E>(self, body: F) -> impl Future<Output = Result<T, E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
    {
        async move {
            use tracing::Instrument;
            let id = &self.op.id;
            // Every event of the call (claim, replay, mismatch, wait, takeover, fence,
            // unknown), the renewal task's and the body's own carry scope, name and key,
            // as the application passed them (decoded only if a subscriber records the
            // span). Debug-formatted (quoted, escaped): a key or scope holding spaces, `=`
            // or newlines cannot forge fields or lines in text logs.
            // A block, so the logged forms are not held across the call's awaits.
            let span = {
                let (scope, key) = (self.idem.log_key(&id.scope), self.idem.log_key(&id.key));
                tracing::info_span!(
                    "idem",
                    scope = ?crate::DisplayKey::new(&scope),
                    name = ?id.name,
                    key = ?crate::DisplayKey::new(&key),
                )
            };
            let call = async {
                let span = tracing::Span::current();
                match self.decide().await? {
                    Decided::Replay(outcome) => {
                        tracing::debug!("replay");
                        metrics::count(metrics::REPLAYS, &id.name);
                        // A recorded `Err` replayed is a replay too (the HTTP layer marks it).
                        context::report_replay();
                        self.op.decode_outcome(outcome.view())
                    }
                    Decided::Unprotected => {
                        tracing::warn!(
                            "store unreachable; running the body unprotected (fail_open)"
                        );
                        let steps = StepsMode::Unprotected;
                        let run = context::scope_body(self.op.id.shared(), 0, steps, body());
                        Box::pin(run).await.0
                    }
                    // Boxed, as is the unprotected run above: the body's future lives in
                    // its own allocation, so a replay's future is the same size whatever
                    // the body holds, and small enough for the allocator's per-thread
                    // cache when a task or a framework boxes it.
                    Decided::Execute(epoch, at) => {
                        context::report_operation(&self.idem, || id.shared(), self.op.retain);
                        Box::pin(self.execute(epoch, at, body, &span)).await
                    }
                }
            };
            // A span no subscriber wants records nothing: no wrapper to enter it on each poll.
            if span.is_disabled() {
                call.await
            } else {
                call.instrument(span).await
            }
        }
    }

    /// Claims, waiting on an in-flight duplicate as configured, until the operation is
    /// ours, replayable, or refused.
    async fn decide(&self) -> Result<Decided, IdemError> {
        let id = &self.op.id;
        let store = self.idem.store();
        // Completed outcomes are immutable until they expire, so a read decides a
        // replay without taking the write path: first this process's own, then the store.
        match self.idem.cache().get(id, &self.fingerprint) {
            Some(Cached::Replay(outcome)) => return Ok(Decided::Replay(outcome)),
            Some(Cached::Mismatch) => return Err(self.mismatch()),
            None => {}
        }
        // A store that answers at once is not timed: no timer, no box. Only the box is
        // held across the wait, not the answer's room.
        let sent = match store.peek_completed(id, &self.fingerprint).now() {
            Ok(answer) => match self.peeked(answer) {
                Some(decided) => return decided,
                None => None,
            },
            Err(read) => {
                let read = metrics::store_call(self.name(), "peek_completed", read);
                Some(Box::pin(bounded(
                    self.idem.store_timeout(),
                    "replay read",
                    read,
                )))
            }
        };
        if let Some(read) = sent
            && let Some(decided) = self.peeked(read.await)
        {
            return decided;
        }
        // No completed outcome: this call may create a record, which is what a claim
        // limit counts. Boxed: only calls with a limit make room for its reads.
        if let Some(limiter) = self.op.claim_limit.as_ref().or(self.idem.claim_limit()) {
            let (store, timeout) = (&**self.idem.store(), self.idem.store_timeout());
            match Box::pin(limiter.admit(store, timeout, id, self.name())).await {
                Ok(()) => {}
                Err(Limited::Refused(e)) => return Err(e),
                Err(Limited::Store(e)) => return self.store_down(e),
            }
        }
        let req = ClaimRequest {
            id,
            fingerprint: self.fingerprint,
            lease: self.op.lease,
            on_takeover: self.op.on_takeover,
        };
        let (retry_after, sent) = match self.claim(&req).await {
            (Err(e), _) => return self.store_down(e),
            (Ok(claim), at) => match self.settle(claim, at)? {
                Settled::Decided(decided) => return Ok(decided),
                Settled::InFlight(retry_after) => (retry_after, at.sent),
            },
        };
        match self.op.in_flight {
            InFlight::Reject => Err(self.in_flight(retry_after)),
            // Boxed: the wait holds timers and a waiter, which the common call's future
            // should not carry.
            InFlight::Wait(d) => Box::pin(self.wait(&req, sent + d, retry_after)).await,
        }
    }

    /// What a replay read decides, if anything: `None` sends the claim.
    #[allow(clippy::type_complexity, reason = "the store's answer as it comes")]
    fn peeked(
        &self,
        read: Result<Option<Result<StoredOutcome, crate::store::Mismatched>>, StoreError>,
    ) -> Option<Result<Decided, IdemError>> {
        match read {
            Ok(Some(Ok(outcome))) => Some(Ok(Decided::Replay(outcome))),
            Ok(Some(Err(_))) => Some(Err(self.mismatch())),
            Ok(None) => None,
            Err(e) => Some(self.store_down(e)),
        }
    }

    /// One claim: taken at once where the store answers in this process, else sent.
    async fn claim(&self, req: &ClaimRequest<'_>) -> (Result<Claim, StoreError>, At) {
        let sent = Instant::now();
        // A store that answers at once has made the claim already; a future that would
        // make a round trip is dropped unpolled (so it has done nothing) and sent again,
        // owned, where it can outlive a cancelled caller.
        if let Ok(answer) = self.idem.store().claim(req).now() {
            let at = At {
                sent,
                at_once: true,
                resume: false,
            };
            return (answer, at);
        }
        // Bounded by the store timeout within. Boxed with its timer: a round trip dwarfs
        // the allocation.
        let claim = ClaimInFlight::send(&self.idem, self.op.id.shared(), req, self.op.retain, sent);
        let answer = Box::pin(claim).await;
        let at = At {
            sent,
            at_once: false,
            resume: false,
        };
        (answer, at)
    }

    /// What a claim's answer decides, or how long the call in flight has left.
    fn settle(&self, claim: Claim, at: At) -> Result<Settled, IdemError> {
        let id = &self.op.id;
        Ok(Settled::Decided(match claim {
            Claim::Acquired {
                epoch,
                takeover,
                resume,
            } => {
                metrics::count(metrics::CLAIMS, self.name());
                if takeover {
                    metrics::count(metrics::TAKEOVERS, self.name());
                    tracing::info!(epoch, "takeover of a lapsed claim");
                } else {
                    tracing::debug!(epoch, "claimed");
                }
                Decided::Execute(epoch, At { resume, ..at })
            }
            Claim::Completed(outcome) => Decided::Replay(outcome),
            Claim::Mismatch => return Err(self.mismatch()),
            Claim::Unknown { epoch, now } => {
                if now {
                    metrics::count(metrics::TAKEOVERS, self.name());
                    metrics::count(metrics::UNKNOWN, self.name());
                    tracing::warn!(
                        epoch,
                        "lapsed claim moved to UNKNOWN (on_takeover = unknown)"
                    );
                    self.idem.wake(id);
                }
                return Err(IdemError::Unknown {
                    name: self.name().to_owned(),
                    epoch,
                });
            }
            Claim::InFlight { retry_after } => return Ok(Settled::InFlight(retry_after)),
        }))
    }

    fn in_flight(&self, retry_after: Duration) -> IdemError {
        metrics::count(metrics::IN_FLIGHT, self.name());
        context::report_operation(&self.idem, || self.op.id.shared(), self.op.retain);
        IdemError::InFlight {
            name: self.name().to_owned(),
            retry_after,
        }
    }

    /// Waits on the call in flight until `deadline`, claiming again whenever it may have
    /// ended, until the operation is ours, replayable, or refused.
    async fn wait(
        &self,
        req: &ClaimRequest<'_>,
        deadline: Instant,
        retry_after: Duration,
    ) -> Result<Decided, IdemError> {
        let id = &self.op.id;
        if Instant::now() >= deadline {
            return Err(self.in_flight(retry_after));
        }
        let Some(waiter) = self.idem.register_waiter(id) else {
            metrics::count(metrics::IN_FLIGHT, self.name());
            return Err(IdemError::TooManyWaiters {
                name: self.name().to_owned(),
                retry_after,
            });
        };
        tracing::debug!(?retry_after, "waiting on in-flight duplicate");
        let announced = bounded(
            self.idem.store_timeout(),
            "wait announcement",
            self.idem.store().announce_wait(id),
        );
        if let Err(e) = announced.await {
            tracing::debug!(error = %e, "could not announce the wait; polling");
        }
        // Re-claim at once: the first call may have finished meanwhile.
        loop {
            let notified = waiter.notify.notified();
            tokio::pin!(notified);
            // Registered before the claim, so a wake between the claim and the sleep is
            // not lost.
            notified.as_mut().enable();
            let (claim, at) = match self.claim(req).await {
                (Ok(claim), at) => (claim, at),
                // Another caller is known to be running it: running it here too, even
                // with `fail_open`, would be the duplicate idem exists to prevent. A
                // transient error is waited out like the in-flight call, to the deadline.
                (Err(e), _) => {
                    let now = Instant::now();
                    if e.retryable && now < deadline {
                        tracing::debug!(error = %e, "claim failed while waiting; retrying");
                        let nap = self.idem.poll_interval().min(deadline - now);
                        tokio::time::sleep(nap).await;
                        continue;
                    }
                    metrics::store_error(self.name(), "claim");
                    return Err(IdemError::store("claim", e));
                }
            };
            let retry_after = match self.settle(claim, at)? {
                Settled::Decided(decided) => return Ok(decided),
                Settled::InFlight(retry_after) => retry_after,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(self.in_flight(retry_after));
            }
            // Wake on completion or release, at the lease's end (to take over), and at
            // the poll interval for changes made by other processes.
            let nap = (retry_after + Duration::from_millis(1))
                .min(self.idem.poll_interval())
                .min(deadline - now);
            let _ = tokio::time::timeout(nap, notified).await;
        }
    }

    /// How long one write of a claim (a confirmation, a record attempt, a release, a
    /// move to UNKNOWN) may wait for the store: the store timeout, but never past a lease.
    fn write_bound(&self) -> Duration {
        self.idem.store_timeout().min(self.op.lease)
    }

    fn mismatch(&self) -> IdemError {
        tracing::info!("fingerprint mismatch");
        metrics::count(metrics::MISMATCHES, self.name());
        IdemError::Mismatch {
            name: self.name().to_owned(),
        }
    }

    fn store_down(&self, e: StoreError) -> Result<Decided, IdemError> {
        match self.op.on_store_error {
            // Only an unreachable store: a refusal, a constraint or contention means the
            // store is up and answered, so running unprotected could duplicate a call.
            OnStoreError::FailOpen if e.unreachable => {
                tracing::warn!(error = %e, "idem store unreachable at claim");
                Ok(Decided::Unprotected)
            }
            _ => {
                metrics::store_error(self.name(), "claim");
                Err(IdemError::store("claim", e))
            }
        }
    }

    /// A block, not an `async fn`, for the reason `run` gives.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn holds its arguments twice"
    )]
    fn execute<'s, F, Fut, E>(
        self,
        epoch: u64,
        at: At,
        body: F,
        span: &'s tracing::Span,
    ) -> impl Future<Output = Result<T, E>> + use<'s, 'a, F, Fut, E, P, U, T>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
    {
        async move {
            let (claimed_at, at_once) = (at.sent, at.at_once);
            let id = &self.op.id;
            // Released if the caller goes away before the body starts: nothing ran.
            let unstarted = Unstarted::arm(
                Armed {
                    idem: &self.idem,
                    id: self.op.id.arc_ref(),
                    epoch,
                    retain: &self.op.retain,
                    bound: self.write_bound(),
                },
                at_once,
            );
            // A claim answered late (a stalled process, a starved scheduler) may have lapsed
            // and been taken over before its body starts: confirm it first rather than run
            // a second body beside the taker's.
            if !at_once && claimed_at.elapsed() >= self.op.lease / 2 {
                let confirm = self.idem.store().renew(id, epoch, self.op.lease);
                let confirm = metrics::store_call(self.name(), "renew", confirm);
                match Box::pin(bounded(self.write_bound(), "claim's confirmation", confirm)).await {
                    Ok(Fence::Held) => {}
                    Ok(Fence::Lost) => {
                        unstarted.disarm();
                        tracing::warn!(parent: span, epoch, "claim lapsed before the body started; not running it");
                        metrics::count(metrics::FENCED, self.name());
                        return Err(IdemError::Fenced {
                            name: self.name().to_owned(),
                            epoch,
                        }
                        .into());
                    }
                    // Not known to be ours, so the body does not run; the guard releases
                    // the claim, fenced by its epoch, since nothing ran under it.
                    Err(e) => return Err(IdemError::store("claim", e).into()),
                }
            }
            unstarted.disarm();
            // Renewed until the outcome is settled, so a record retried after a slow body
            // still has the lease the renewals kept alive.
            // The operation's own identity, shared with the body's context and the lease's
            // renewals: no copy of its strings.
            let shared = self.op.id.shared();
            let mut lease = Lease::hold(
                self.idem.renews_leases().then(|| self.idem.renewer()),
                self.idem.store(),
                self.op.id.arc_ref(),
                epoch,
                self.op.lease,
                self.idem.store_timeout(),
                claimed_at,
            );
            // Timed only where the histogram exists: two clock reads per call otherwise.
            #[cfg(feature = "metrics")]
            let started = Instant::now();
            let steps = if at.resume {
                StepsMode::Resumed(self.idem.clone(), lease.watch())
            } else {
                StepsMode::Leased(self.idem.clone(), lease.watch())
            };
            // Renewals start once the body waits: one that ends on its first poll never
            // needed one, and costs no entry in the renewal schedule.
            let run = std::pin::pin!(context::scope_body(shared, epoch, steps, body()));
            let (out, unrecorded_step) = lease.renewed_while(run).await;
            #[cfg(feature = "metrics")]
            metrics::body_time(self.name(), started.elapsed());
            let lease_end = &lease;

            let max = self.idem.max_outcome_bytes();
            let (outcome, result) = match self.op.encode(out, max, false) {
                Encoded::Record(outcome, result) => (outcome, result),
                // A step's effect happened unrecorded: a release would run it again.
                Encoded::Release(err) if unrecorded_step => {
                    tracing::warn!(parent: span, epoch, "a step ran unrecorded; not releasing");
                    Box::pin(self.settle_unknown(epoch, lease_end)).await;
                    context::report_unknown(epoch);
                    return Err(err);
                }
                Encoded::Release(err) => {
                    let release = self.idem.store().release(id, epoch, self.op.retain);
                    let release = metrics::store_call(self.name(), "release", release);
                    match Box::pin(bounded(self.write_bound(), "release", release)).await {
                        Ok(Fence::Held) => {
                            tracing::debug!(parent: span, epoch, "released after error")
                        }
                        Ok(Fence::Lost) => {
                            tracing::warn!(parent: span, epoch, "fenced: claim lost before release")
                        }
                        // The lease will lapse and a retry takes over: the contract allows
                        // a released error to run again.
                        Err(e) => tracing::warn!(parent: span, epoch, error = %e, "release failed"),
                    }
                    self.idem.wake(id);
                    context::report_run(epoch, false);
                    return Err(err);
                }
                Encoded::Unknown(err) => {
                    Box::pin(self.settle_unknown(epoch, lease_end)).await;
                    context::report_unknown(epoch);
                    return Err(err);
                }
                // The body ran; a release would run it again, so park it in UNKNOWN.
                Encoded::Unrecordable(why) => {
                    let then = Box::pin(self.settle_unknown(epoch, lease_end)).await;
                    context::report_unknown(epoch);
                    return Err(why.error(self.name(), max, then).into());
                }
            };
            self.record(epoch, claimed_at, outcome, lease_end, span)
                .await?;
            context::report_run(epoch, true);
            result
        }
    }

    /// Records, retrying a retryable store error while the lease may still hold, for at
    /// most one lease: from the first attempt, or from the last renewal the store
    /// confirmed if that is earlier (renewals keep running meanwhile). The store extends
    /// a lease from its own clock when the statement runs, which may be well after it was
    /// sent, so the lease this process can prove is shorter than the real one; every
    /// attempt is fenced, so one that lands after a takeover changes nothing and reports
    /// `Fenced`. One attempt waits at most the write bound and half a lease: an attempt
    /// that timed out has its connection closed, and the next goes out on another, so a
    /// record that landed but whose reply was lost is found by the retry.
    async fn record(
        &self,
        epoch: u64,
        claimed_at: Instant,
        outcome: StoredOutcome,
        lease: &Lease<'_>,
        span: &tracing::Span,
    ) -> Result<(), IdemError> {
        let id = &self.op.id;
        let at_once = match self
            .idem
            .store()
            .record(id, epoch, &outcome, self.op.retain)
            .now()
        {
            Ok(Ok(fence)) => Some(fence),
            _ => None,
        };
        match at_once {
            // Answered in this process: no retries, and no cache to fill beside the store.
            Some(fence) => self.recorded(epoch, fence, span),
            // Boxed: its retries hold timers a store that answers at once should not
            // carry in every call's future, and a round trip dwarfs the allocation.
            None => Box::pin(self.record_in_store(epoch, claimed_at, outcome, lease, span)).await,
        }
    }

    async fn record_in_store(
        &self,
        epoch: u64,
        claimed_at: Instant,
        outcome: StoredOutcome,
        lease: &Lease<'_>,
        span: &tracing::Span,
    ) -> Result<(), IdemError> {
        let id = &self.op.id;
        let mut backoff = Duration::from_millis(20);
        let mut gone_checked = false;
        // The cache's entry lives `retain` from the claim's send: the store's retention
        // deadline is no earlier than that (a store may take it from a bound on its
        // clock that the claim's answer gave). The cache keeps time by the standard
        // clock, like its reads.
        let now = std::time::Instant::now();
        let cached_from = now.checked_sub(claimed_at.elapsed());
        let started = Instant::from_std(now);
        let each = self.write_bound().min(self.op.lease / 2);
        let mut first = true;
        loop {
            // Each attempt gets `each`, cut to what is left of the window below; the first
            // gets it whole, so a late record after a partition still learns `Fenced`.
            let window =
                lease.held_until().map_or(started, |held| started.min(held)) + self.op.lease;
            let now = Instant::now();
            let attempt = if first {
                now + each
            } else {
                (now + each).min(window)
            };
            first = false;
            let record = self
                .idem
                .store()
                .record(id, epoch, &outcome, self.op.retain);
            let record = metrics::store_call(self.name(), "record", record);
            let answer = match tokio::time::timeout_at(attempt, record).await {
                Ok(answer) => answer,
                Err(_) => Err(no_answer("record", attempt - started)),
            };
            match answer {
                Ok(fence) => {
                    if fence == Fence::Held
                        && let Some(from) = cached_from
                    {
                        self.idem
                            .cache()
                            .put(id, self.fingerprint, outcome, from, self.op.retain);
                    }
                    return self.recorded(epoch, fence, span);
                }
                Err(e) => {
                    let now = Instant::now();
                    let Some(held_until) = lease.held_until() else {
                        // A renewal found the claim gone: taken over, resolved, or
                        // completed by this very record whose reply was lost. Records are
                        // fenced and idempotent per epoch, so one more attempt tells which.
                        if !gone_checked {
                            gone_checked = true;
                            tokio::time::sleep(backoff).await;
                            continue;
                        }
                        tracing::warn!(parent: span, epoch, "fenced: the claim was taken over or resolved");
                        metrics::count(metrics::FENCED, self.name());
                        return Err(IdemError::Fenced {
                            name: self.name().to_owned(),
                            epoch,
                        });
                    };
                    if !e.retryable || now + backoff >= started.min(held_until) + self.op.lease {
                        tracing::error!(parent: span, epoch, error = %e, "outcome unrecorded");
                        metrics::store_error(self.name(), "record");
                        return Err(IdemError::Unrecorded {
                            name: self.name().to_owned(),
                            epoch,
                            source: e.source,
                        });
                    }
                    tracing::warn!(parent: span, epoch, error = %e, "record failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// What a record the store answered means for the caller.
    fn recorded(&self, epoch: u64, fence: Fence, span: &tracing::Span) -> Result<(), IdemError> {
        match fence {
            Fence::Held => {
                tracing::debug!(parent: span, epoch, "recorded");
                self.idem.wake(&self.op.id);
                Ok(())
            }
            Fence::Lost => {
                tracing::warn!(parent: span, epoch, "fenced: lease lapsed and another caller took over");
                metrics::count(metrics::FENCED, self.name());
                Err(IdemError::Fenced {
                    name: self.name().to_owned(),
                    epoch,
                })
            }
        }
    }

    /// Moves the claim to UNKNOWN, retrying a retryable error until the lease as it
    /// stands when the move begins would lapse (boxed where it is awaited: a rare path,
    /// kept out of every call's future). The renewals go on meanwhile, but do not extend
    /// the retries: past that lease another caller may hold the operation. If the move
    /// fails, the claim stays IN_PROGRESS and its lease lapses, which `on_takeover` then
    /// governs. Returns what became of the operation, for the caller's error message.
    async fn settle_unknown(&self, epoch: u64, lease: &Lease<'_>) -> &'static str {
        let id = &self.op.id;
        let until = lease.held_until();
        let mut bound = self.write_bound();
        loop {
            let mark = self.idem.store().mark_unknown(id, epoch);
            let mark = metrics::store_call(self.name(), "mark_unknown", mark);
            match bounded(bound, "move to UNKNOWN", mark).await {
                Ok(Fence::Held) => {
                    tracing::warn!(epoch, "operation moved to UNKNOWN");
                    metrics::count(metrics::UNKNOWN, self.name());
                    self.idem.wake(id);
                    return "the operation is now UNKNOWN; resolve it once you know whether the \
                            effect happened";
                }
                Ok(Fence::Lost) => {
                    tracing::warn!(
                        epoch,
                        "fenced: another claim owns the operation; not marked UNKNOWN"
                    );
                    return "another claim took the operation over after this one's lease lapsed, \
                            so it was not marked UNKNOWN";
                }
                Err(e)
                    if e.retryable
                        && until.is_some_and(|t| Instant::now() + UNKNOWN_RETRY_EVERY < t) =>
                {
                    tracing::warn!(epoch, error = %e, "could not mark UNKNOWN; retrying");
                    tokio::time::sleep(UNKNOWN_RETRY_EVERY).await;
                    // The next attempt ends with the lease too.
                    let left = until.map_or(Duration::ZERO, |t| {
                        t.saturating_duration_since(Instant::now())
                    });
                    bound = self.write_bound().min(left.max(UNKNOWN_RETRY_EVERY));
                }
                Err(e) => {
                    tracing::error!(epoch, error = %e, "could not mark UNKNOWN");
                    return "it could not be marked UNKNOWN (the store failed), so it stays in \
                            progress until its lease lapses and `on_takeover` applies";
                }
            }
        }
    }
}

/// The pause between attempts to move a claim to UNKNOWN.
const UNKNOWN_RETRY_EVERY: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    /// A call's future is what a framework boxes or a task holds, for every call. It
    /// holds the operation once, an invalid configuration's error boxed, and the rare
    /// paths' timers (waiting on a duplicate, record retries, settling UNKNOWN) and the
    /// body's run in boxes of their own; `go` and `execute` are blocks, since as `async
    /// fn`s they would hold their arguments twice. Under 1 KiB, a boxed call is served
    /// from glibc's per-thread cache rather than its shared heap. The bound is for this
    /// toolchain, this call, every feature on.
    #[test]
    fn a_calls_future_stays_small() {
        let idem = crate::Idem::memory();
        let call = idem
            .operation("charge", &7u64)
            .fingerprint(&(7u64, "EUR"))
            .retain(std::time::Duration::from_secs(86_400))
            .run(|| async { Ok::<_, crate::IdemError>(5u64) });
        let size = std::mem::size_of_val(&call);
        assert!(size <= 696, "a call's future grew to {size} bytes");
    }

    /// The body runs in a future of its own: a body that holds 4 KiB across an await
    /// leaves the call's future the size of a trivial body's.
    #[test]
    fn a_calls_future_is_the_same_size_whatever_the_body_holds() {
        let idem = crate::Idem::memory();
        let op = || {
            idem.operation("charge", &7u64)
                .fingerprint(&7u64)
                .retain(std::time::Duration::from_secs(60))
        };
        let trivial = op().run(|| async { Ok::<_, crate::IdemError>(5u64) });
        let holding = op().run(|| async {
            let buf = [7u8; 4096];
            tokio::task::yield_now().await;
            Ok::<_, crate::IdemError>(u64::from(std::hint::black_box(buf)[4095]))
        });
        let (trivial, holding) = (
            std::mem::size_of_val(&trivial),
            std::mem::size_of_val(&holding),
        );
        assert_eq!(holding, trivial, "a body's 4 KiB grew the call's future");
    }
}
