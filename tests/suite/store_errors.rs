//! A store that fails: fail closed, fail open, unrecorded outcomes.
use crate::common;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_runtime::store::{
    Claim, ClaimRequest, Delegate, Fence, MemoryStore, Mismatched, Store, StoreError, StoredOutcome,
};
use idem_runtime::{Idem, IdemError, OnStoreError, OperationId};

/// The memory store with switches that make claims or records fail like a dropped
/// connection.
#[derive(Default)]
struct Flaky {
    inner: MemoryStore,
    claims_fail: AtomicBool,
    records_fail: AtomicBool,
    /// The next record commits, then its reply is lost.
    lose_record_reply: AtomicBool,
    /// ... and the lost reply arrives only after a renewal has found the claim settled.
    lost_reply_after_renewal: AtomicBool,
    renewal_found_lost: tokio::sync::Notify,
    /// Claims beyond this many fail (0: no limit).
    claims_before_failing: std::sync::atomic::AtomicUsize,
    claims: std::sync::atomic::AtomicUsize,
    /// Claims fail with this error instead (the store answered: not unreachable).
    refuse: std::sync::Mutex<Option<fn() -> StoreError>>,
    /// Claims numbered in this range fail like a dropped connection.
    fail_window: std::sync::Mutex<std::ops::Range<usize>>,
    /// The next claim's reply is held until this fires (a slow network, a stalled
    /// process); `claim_landed` is notified once the claim is in the store.
    hold_claim_reply: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    claim_landed: tokio::sync::Notify,
    /// The next renewal is held, before it reaches the store, until this fires;
    /// `renew_sent` is notified when it is.
    hold_renew: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    renew_sent: tokio::sync::Notify,
    /// Moves to UNKNOWN fail with this error, and are counted.
    mark_unknown_fails: std::sync::Mutex<Option<fn() -> StoreError>>,
    marks: std::sync::atomic::AtomicUsize,
}

fn refusal() -> StoreError {
    StoreError::new(false, "invalid byte sequence for encoding \"UTF8\": 0x00")
}

fn raced() -> StoreError {
    StoreError::new(
        true,
        "the claim raced concurrent writers 5 times in a row; retry",
    )
}

fn down() -> StoreError {
    StoreError::new(
        true,
        std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset"),
    )
}

#[async_trait::async_trait]
impl Delegate for Flaky {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let n = self.claims.fetch_add(1, Ordering::SeqCst) + 1;
        let limit = self.claims_before_failing.load(Ordering::SeqCst);
        if self.claims_fail.load(Ordering::SeqCst)
            || (limit > 0 && n > limit)
            || self.fail_window.lock().unwrap().contains(&n)
        {
            return Err(down());
        }
        if let Some(refuse) = *self.refuse.lock().unwrap() {
            return Err(refuse());
        }
        let held = self.hold_claim_reply.lock().unwrap().take();
        let claim = self.inner.claim(req).await;
        if let Some(held) = held {
            self.claim_landed.notify_one();
            let _ = held.await;
        }
        claim
    }
    // A store that is down answers no read either.
    async fn peek_completed(
        &self,
        id: &OperationId,
        fingerprint: &[u8; 32],
    ) -> Result<Option<Result<StoredOutcome, Mismatched>>, StoreError> {
        if self.claims_fail.load(Ordering::SeqCst) {
            return Err(down());
        }
        self.inner.peek_completed(id, fingerprint).await
    }
    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        o: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        if self.records_fail.load(Ordering::SeqCst) {
            return Err(down());
        }
        let fence = self.inner.record(id, epoch, o, retain).await;
        if self.lose_record_reply.swap(false, Ordering::SeqCst) {
            if self.lost_reply_after_renewal.load(Ordering::SeqCst) {
                self.renewal_found_lost.notified().await;
            }
            return Err(down());
        }
        fence
    }
    async fn renew(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        let held = self.hold_renew.lock().unwrap().take();
        if let Some(held) = held {
            self.renew_sent.notify_one();
            let _ = held.await;
        }
        let fence = self.inner.renew(id, epoch, lease).await;
        if matches!(fence, Ok(Fence::Lost)) {
            self.renewal_found_lost.notify_one();
        }
        fence
    }
    async fn mark_unknown(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.marks.fetch_add(1, Ordering::SeqCst);
        if let Some(fail) = *self.mark_unknown_fails.lock().unwrap() {
            return Err(fail());
        }
        self.inner.mark_unknown(id, epoch).await
    }
}

fn flaky() -> (Arc<Flaky>, Idem) {
    flaky_with(|b| b)
}

fn flaky_with(
    opts: impl Fn(idem_runtime::IdemBuilder) -> idem_runtime::IdemBuilder,
) -> (Arc<Flaky>, Idem) {
    let f = Arc::new(Flaky::default());
    let idem = opts(Idem::builder()).store(f.clone() as Arc<dyn Delegate>);
    (f, idem)
}

#[tokio::test]
async fn fail_closed_does_not_run_the_body() {
    let (f, idem) = flaky();
    f.claims_fail.store(true, Ordering::SeqCst);
    let mut ran = false;
    let r = idem
        .operation("charge", "k")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            ran = true;
            Ok::<_, IdemError>(())
        })
        .await;
    assert!(
        matches!(&r, Err(e @ IdemError::Store { .. }) if e.is_retryable()),
        "{r:?}"
    );
    assert!(!ran);
}

#[tokio::test]
async fn fail_open_runs_the_body_unprotected() {
    let (f, idem) = flaky();
    f.claims_fail.store(true, Ordering::SeqCst);
    let r = idem
        .operation("notify", "k")
        .on_store_error(OnStoreError::FailOpen)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(idem_runtime::current().epoch()) })
        .await;
    assert_eq!(r.unwrap(), 0, "an unprotected run has no epoch");
}

/// An outcome the store would not take is reported as unrecorded, once its retries are
/// spent, and the body is not run again: the claim stays in progress.
#[tokio::test]
async fn unrecorded_outcome_is_reported_and_not_rerun() {
    let (f, idem) = flaky();
    f.records_fail.store(true, Ordering::SeqCst);
    let mut runs = 0;
    let r = idem
        .operation("charge", "k2")
        .lease(Duration::from_millis(300))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            runs += 1;
            Ok::<_, IdemError>(())
        })
        .await;
    assert!(
        matches!(r, Err(IdemError::Unrecorded { epoch: 1, .. })),
        "{r:?}"
    );
    assert_eq!(runs, 1);
    // The claim stays in progress, neither released nor settled: duplicates are held off
    // until its lease lapses. Asked of the store rather than of a duplicate, which would
    // run the body once the short lease (it keeps the record's retries short) had lapsed,
    // as it may by then on a slow machine.
    let stats = idem.stats().await.unwrap();
    assert_eq!(
        (stats.in_progress, stats.completed, stats.unknown),
        (1, 0, 0),
        "{stats:?}"
    );
}

#[tokio::test]
async fn no_store_is_a_clear_error() {
    let r = idem_runtime::__private::global_operation("x", "k")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await;
    assert!(matches!(r, Err(IdemError::NoStore)), "{r:?}");
    assert!(IdemError::NoStore.to_string().contains("set_global"));
}

#[tokio::test]
async fn recent_outcomes_replay_from_this_process_without_the_store() {
    for cache in [true, false] {
        let (f, idem) = flaky_with(|b| if cache { b } else { b.replay_cache_bytes(0) });
        let call = |amount: u32| {
            idem.operation("charge", "k3")
                .fingerprint(&amount)
                .retain(std::time::Duration::from_secs(86_400))
                .run(move || async move { Ok::<_, IdemError>(amount) })
        };
        assert_eq!(call(5).await.unwrap(), 5);
        f.claims_fail.store(true, Ordering::SeqCst);
        let again = call(5).await;
        let other = call(6).await;
        if cache {
            assert_eq!(again.unwrap(), 5, "replayed from the cache");
            assert!(
                matches!(other, Err(IdemError::Mismatch { .. })),
                "{other:?}"
            );
        } else {
            assert!(matches!(again, Err(IdemError::Store { .. })), "{again:?}");
        }
    }
}

#[tokio::test]
async fn a_record_whose_reply_was_lost_is_not_reported_as_fenced() {
    let (f, idem) = flaky_with(|b| b.replay_cache_bytes(0));
    f.lose_record_reply.store(true, Ordering::SeqCst);
    let mut runs = 0;
    let r = idem
        .operation("charge", "k4")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            runs += 1;
            Ok::<_, IdemError>(7u32)
        })
        .await;
    assert_eq!(
        r.unwrap(),
        7,
        "the retried record finds its own outcome and holds"
    );
    assert_eq!(runs, 1);
    let again = idem
        .operation("charge", "k4")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(8u32) })
        .await;
    assert_eq!(again.unwrap(), 7);
}

#[tokio::test]
async fn fail_open_never_runs_a_duplicate_of_a_call_known_to_be_running() {
    let (f, idem) = flaky();
    // The first call's claim and the waiter's first claim succeed; the store then fails.
    f.claims_before_failing.store(2, Ordering::SeqCst);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("notify", "k5")
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    let _ = started_tx.send(());
                    let _ = go_rx.await;
                    Ok::<_, IdemError>(1u8)
                })
                .await
        })
    };
    started_rx.await.unwrap();
    let mut ran = false;
    let r = idem
        .operation("notify", "k5")
        .on_store_error(OnStoreError::FailOpen)
        .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(1)))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            ran = true;
            Ok::<_, IdemError>(2u8)
        })
        .await;
    assert!(matches!(r, Err(IdemError::Store { .. })), "{r:?}");
    assert!(!ran, "fail_open ran a duplicate of a running call");
    go_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 1);
}

#[tokio::test]
async fn fail_open_runs_nothing_when_the_store_answers_with_a_refusal() {
    for error in [refusal as fn() -> StoreError, raced] {
        let (f, idem) = flaky();
        *f.refuse.lock().unwrap() = Some(error);
        let mut ran = false;
        let r = idem
            .operation("notify", "k6")
            .on_store_error(OnStoreError::FailOpen)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                ran = true;
                Ok::<_, IdemError>(())
            })
            .await;
        assert!(matches!(r, Err(IdemError::Store { .. })), "{r:?}");
        assert!(!ran, "fail_open ran the body on {}", error());
    }
}

#[tokio::test]
async fn a_waiter_rides_out_transient_claim_errors() {
    let (f, idem) = flaky_with(|b| b.poll_interval(Duration::from_millis(10)));
    // Claims 3 to 5 (the waiter's re-claims) fail like a dropped connection.
    *f.fail_window.lock().unwrap() = 3..6;
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("charge", "k7")
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    let _ = started_tx.send(());
                    let _ = go_rx.await;
                    Ok::<_, IdemError>(1u8)
                })
                .await
        })
    };
    started_rx.await.unwrap();
    let waiter = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("charge", "k7")
                .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(60)))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async { Ok::<_, IdemError>(2u8) })
                .await
        })
    };
    // Let the waiter meet the failing claims before the first call finishes (or give up
    // on them, which is the failure this test looks for).
    while f.claims.load(Ordering::SeqCst) < 6 && !waiter.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    go_tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(
        waiter.await.unwrap().unwrap(),
        1,
        "the waiter replays the outcome"
    );
}

/// A key PostgreSQL refuses (a NUL byte in TEXT) is a refusal, not an outage: with
/// `fail_open` the body still does not run.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn fail_open_does_not_run_on_a_postgres_refusal() {
    let Some(ctx) = common::Ctx::open(common::Backend::Postgres, "fail_open_nul").await else {
        return;
    };
    let mut ran = false;
    let r = ctx
        .idem
        .operation("notify", "a\0b")
        .on_store_error(OnStoreError::FailOpen)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            ran = true;
            Ok::<_, IdemError>(())
        })
        .await;
    assert!(matches!(&r, Err(IdemError::Store { .. })), "{r:?}");
    assert!(!ran, "fail_open ran the body on a refused key");
    ctx.cleanup().run().await;
}

#[tokio::test]
async fn a_claim_answered_after_its_lease_lapsed_runs_no_body() {
    let (f, idem) = flaky();
    let (reply, held) = tokio::sync::oneshot::channel();
    *f.hold_claim_reply.lock().unwrap() = Some(held);
    let ran_late = Arc::new(AtomicBool::new(false));
    let late = {
        let (idem, ran_late) = (idem.clone(), ran_late.clone());
        tokio::spawn(async move {
            idem.operation("charge", "k")
                .lease(Duration::from_millis(100))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async move {
                    ran_late.store(true, Ordering::SeqCst);
                    Ok::<_, IdemError>(1)
                })
                .await
        })
    };
    f.claim_landed.notified().await;
    // The claim's lease lapses while its reply is in transit; another caller takes over.
    let mut reply = Some(reply);
    let taker = loop {
        let r = idem
            .operation("charge", "k")
            .lease(Duration::from_secs(30))
            .in_flight(idem_runtime::InFlight::Reject)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                // Only now does the late claimant hear it won.
                let _ = reply.take().unwrap().send(());
                Ok::<_, IdemError>(2)
            })
            .await;
        match r {
            Err(IdemError::InFlight { retry_after, .. }) => tokio::time::sleep(retry_after).await,
            other => break other,
        }
    };
    assert_eq!(taker.unwrap(), 2);
    let late = late.await.unwrap();
    assert!(
        matches!(late, Err(IdemError::Fenced { epoch: 1, .. })),
        "{late:?}"
    );
    assert!(
        !ran_late.load(Ordering::SeqCst),
        "the superseded claim ran its body"
    );
}

#[tokio::test]
async fn a_lost_record_reply_after_the_renewal_saw_it_settled_is_still_ours() {
    let (f, idem) = flaky_with(|b| b.replay_cache_bytes(0));
    f.lose_record_reply.store(true, Ordering::SeqCst);
    f.lost_reply_after_renewal.store(true, Ordering::SeqCst);
    let r = idem
        .operation("charge", "k5")
        // Short.retain(std::time::Duration::from_secs(86_400)).fingerprint_none(), so the renewal runs while the record's reply is in flight.
        .lease(Duration::from_millis(90))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(7u32) })
        .await;
    assert_eq!(r.unwrap(), 7, "the record landed: not Fenced");
}

/// A layer wrapped around the memory store stands between every call and the store:
/// its failures are the calls' failures, though `Idem::memory` alone calls its store
/// directly.
#[tokio::test]
async fn a_layer_around_the_memory_store_sees_every_call() {
    let seen: Arc<std::sync::Mutex<Option<Arc<Flaky>>>> = Arc::default();
    let s = seen.clone();
    let idem = Idem::builder()
        .layer(move |_memory| {
            let flaky = Arc::new(Flaky::default());
            *s.lock().unwrap() = Some(flaky.clone());
            Arc::new(flaky as Arc<dyn Delegate>)
        })
        .memory();
    let flaky = seen.lock().unwrap().take().expect("the layer ran");
    flaky.claims_fail.store(true, Ordering::SeqCst);
    let runs = common::Counter::default();
    let day = Duration::from_secs(86_400);
    let r = common::counted_call(&idem, "send", "k", day, &runs, 1).await;
    assert!(
        matches!(r, Err(IdemError::Store { .. })),
        "the layer's failing claim did not reach the call: {r:?}"
    );
    assert_eq!(runs.get(), 0);
}

/// A caller that goes away while its claim is on the wire ran no body: the claim the
/// store made for it is released, so the next caller runs the body, even with
/// `on_takeover = unknown`, which would otherwise park the lapsed claim in UNKNOWN.
#[tokio::test]
async fn a_claim_cancelled_before_its_body_started_is_released() {
    let (f, idem) = flaky();
    let (reply, held) = tokio::sync::oneshot::channel();
    *f.hold_claim_reply.lock().unwrap() = Some(held);
    let op = |idem: &Idem| {
        idem.operation("email", "welcome-7")
            .lease(Duration::from_millis(200))
            .on_takeover(idem_runtime::Takeover::Unknown)
            .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(30)))
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
    };
    let ran_first = Arc::new(AtomicBool::new(false));
    let first = {
        let (idem, ran_first) = (idem.clone(), ran_first.clone());
        tokio::spawn(async move {
            op(&idem)
                .run(|| async move {
                    ran_first.store(true, Ordering::SeqCst);
                    Ok::<_, IdemError>(1)
                })
                .await
        })
    };
    f.claim_landed.notified().await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // The store answers the abandoned claim only now.
    let _ = reply.send(());
    let mut ran = false;
    let second = op(&idem)
        .run(|| async {
            ran = true;
            Ok::<_, IdemError>(2)
        })
        .await;
    assert_eq!(
        second.unwrap(),
        2,
        "the unstarted claim was not released: the next caller did not run the body"
    );
    assert!(ran);
    assert!(!ran_first.load(Ordering::SeqCst));
}

/// A claim answered late is confirmed before its body starts; a caller that goes away
/// during that confirmation ran no body either, and its claim is released.
#[tokio::test]
async fn a_claim_cancelled_while_confirmed_is_released() {
    let (f, idem) = flaky();
    let (claim_reply, claim_held) = tokio::sync::oneshot::channel();
    *f.hold_claim_reply.lock().unwrap() = Some(claim_held);
    let (_renew_reply, renew_held) = tokio::sync::oneshot::channel::<()>();
    *f.hold_renew.lock().unwrap() = Some(renew_held);
    let lease = Duration::from_millis(400);
    let op = move |idem: &Idem| {
        idem.operation("email", "welcome-8")
            .lease(lease)
            .on_takeover(idem_runtime::Takeover::Unknown)
            .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(30)))
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
    };
    let first = {
        let idem = idem.clone();
        tokio::spawn(async move { op(&idem).run(|| async { Ok::<_, IdemError>(1) }).await })
    };
    f.claim_landed.notified().await;
    // Answered after half the lease: the call confirms its claim before the body.
    tokio::time::sleep(lease / 2 + Duration::from_millis(20)).await;
    let _ = claim_reply.send(());
    f.renew_sent.notified().await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    let second = op(&idem).run(|| async { Ok::<_, IdemError>(2) }).await;
    assert_eq!(
        second.unwrap(),
        2,
        "the claim cancelled while confirmed was not released"
    );
}

/// A body whose error may have taken effect, on a store that cannot move it to UNKNOWN.
/// Renewals keep the lease alive meanwhile; the retries stop with the lease as it was
/// first granted, and the call returns the body's error, its claim left in progress.
async fn unknown_move_failing_with(fail: fn() -> StoreError) -> (Arc<Flaky>, Idem) {
    let (f, idem) = flaky();
    *f.mark_unknown_fails.lock().unwrap() = Some(fail);
    let call = idem
        .operation("email", "receipt-9")
        .lease(Duration::from_secs(1))
        .classify(|_: &common::AppError| idem_runtime::Disposition::Unknown)
        .retain(Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Err::<u8, _>(common::AppError::Timeout) });
    // An outer bound only, so a regression fails rather than hangs.
    let r = tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("the call did not return: the move to UNKNOWN was retried past its lease");
    assert_eq!(r, Err(common::AppError::Timeout));
    let stats = idem.stats().await.unwrap();
    assert_eq!(
        (stats.in_progress, stats.unknown),
        (1, 0),
        "the claim stays in progress for its lease to lapse: {stats:?}"
    );
    (f, idem)
}

#[tokio::test]
async fn a_move_to_unknown_that_keeps_failing_returns_with_the_first_lease() {
    let (f, _idem) = unknown_move_failing_with(down).await;
    assert!(
        f.marks.load(Ordering::SeqCst) > 1,
        "a transient error is retried"
    );
}

#[tokio::test]
async fn a_move_to_unknown_the_store_refuses_is_not_retried() {
    let (f, _idem) = unknown_move_failing_with(refusal).await;
    assert_eq!(f.marks.load(Ordering::SeqCst), 1, "a refusal was retried");
}
