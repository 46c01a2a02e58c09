//! Leases: cancellation, takeover, renewal and fencing.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{IdemError, InFlight, ListFilter, State, Takeover, current, observe};
use std::time::Duration;
use tokio::sync::oneshot;

suite!(
    cancelled_body_keeps_claim_until_lease_then_taken_over,
    lapsed_claim_goes_unknown_when_asked,
    live_slow_body_is_renewed_not_taken_over,
    late_finisher_is_fenced,
    panicked_body_keeps_claim
);

/// Starts a call whose body never finishes; returns its task once the body runs, with
/// the body's downstream key and epoch.
async fn start_pending(
    idem: &idem_runtime::Idem,
    key: &str,
    lease: Duration,
) -> (
    tokio::task::JoinHandle<Result<u64, IdemError>>,
    (String, u64),
) {
    let (tx, rx) = oneshot::channel();
    let idem2 = idem.clone();
    let key2 = key.to_string();
    let task = tokio::spawn(async move {
        idem2
            .operation("ship", &key2)
            .lease(lease)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                let _ = tx.send((current().downstream_key("carrier"), current().epoch()));
                std::future::pending::<()>().await;
                Ok::<_, IdemError>(0u64)
            })
            .await
    });
    let downstream = rx.await.expect("body started");
    (task, downstream)
}

/// Starts a call whose body signals, then never finishes, and aborts it; returns the
/// body's downstream key and epoch.
async fn start_and_cancel(idem: &idem_runtime::Idem, key: &str, lease: Duration) -> (String, u64) {
    let (task, downstream) = start_pending(idem, key, lease).await;
    task.abort();
    let _ = task.await;
    downstream
}

async fn cancelled_body_keeps_claim_until_lease_then_taken_over(ctx: Ctx) {
    // Long enough that no scheduling stall on a loaded machine lapses it before the
    // duplicate below checks it.
    let lease = Duration::from_secs(5);
    let (first_key, first_epoch) = start_and_cancel(&ctx.idem, "parcel-1", lease).await;

    // The caller went away; the claim did not.
    let r = ctx
        .idem
        .operation("ship", "parcel-1")
        .in_flight(InFlight::Reject)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(1u64) })
        .await;
    match r {
        // A store with a millisecond clock holds a lease up to 2 ms past its length.
        Err(IdemError::InFlight { retry_after, .. }) => {
            assert!(retry_after <= lease + Duration::from_millis(2))
        }
        other => panic!("expected in-flight, got {other:?}"),
    }

    // A waiting duplicate takes over once the lease lapses, at a higher epoch, with the
    // same downstream key.
    let (r, info) = observe(
        ctx.idem
            .operation("ship", "parcel-1")
            .in_flight(InFlight::Wait(Duration::from_secs(30)))
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                let cur = current();
                Ok::<_, IdemError>((cur.epoch(), cur.downstream_key("carrier")))
            }),
    )
    .await;
    // Epochs grow; they are not attempt counts (a claim that found the key taken may
    // have drawn one it did not use).
    let (epoch, key) = r.unwrap();
    assert!(epoch > first_epoch, "{epoch} after {first_epoch}");
    assert_eq!(info.epoch(), Some(epoch));
    assert_eq!(key, first_key);
}

async fn lapsed_claim_goes_unknown_when_asked(ctx: Ctx) {
    let (_, first) = start_and_cancel(&ctx.idem, "parcel-2", Duration::from_millis(300)).await;
    let runs = Counter::default();
    let r = ctx
        .idem
        .operation("ship", "parcel-2")
        .on_takeover(Takeover::Unknown)
        .in_flight(InFlight::Wait(Duration::from_secs(30)))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            runs.hit();
            Ok::<_, IdemError>(1u64)
        })
        .await;
    assert!(
        matches!(r, Err(IdemError::Unknown { epoch, .. }) if epoch == first),
        "{r:?}"
    );
    assert_eq!(runs.get(), 0);
    let listed = ctx.idem.list(&ListFilter::unknown()).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].state, State::Unknown);
}

/// A body that runs two leases long keeps its claim, renewed in the background: the
/// duplicate waiting on it never takes it over.
async fn live_slow_body_is_renewed_not_taken_over(ctx: Ctx) {
    // Renewed every second, each renewal given a second to answer: only renewals lost or
    // stalled for two seconds running could lose it, even on a slow store.
    let runs = slow_body_beside_a_duplicate(&ctx.idem, "r-1", Duration::from_secs(3)).await;
    assert_eq!(runs, 1, "a live body's claim was taken over");
}

async fn late_finisher_is_fenced(ctx: Ctx) {
    let idem = ctx.variant(|b| b.renew_leases(false)).await;
    let lease = Duration::from_millis(200);
    let (started_tx, started_rx) = oneshot::channel::<u64>();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let late = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("refund", "f-1")
                .lease(lease)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    let _ = started_tx.send(current().epoch());
                    let _ = finish_rx.await;
                    Ok::<_, IdemError>(0)
                })
                .await
        })
    };
    let late_epoch = started_rx.await.unwrap();
    let taker = idem
        .operation("refund", "f-1")
        .lease(Duration::from_secs(30))
        .in_flight(InFlight::Wait(Duration::from_secs(30)))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(current().epoch()) })
        .await
        .unwrap();
    assert!(taker > late_epoch, "{taker} after {late_epoch}");
    finish_tx.send(()).unwrap();
    let r = late.await.unwrap();
    assert!(
        matches!(r, Err(IdemError::Fenced { epoch, .. }) if epoch == late_epoch),
        "{r:?}"
    );
    // The late outcome was not written over the takeover's.
    let again = idem
        .operation("refund", "f-1")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(0) })
        .await
        .unwrap();
    assert_eq!(again, taker);
}

async fn panicked_body_keeps_claim(ctx: Ctx) {
    let idem = ctx.idem.clone();
    let crashed = tokio::spawn(async move {
        idem.operation("ship", "parcel-p")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                if true {
                    panic!("the body crashed");
                }
                Ok::<_, IdemError>(0u64)
            })
            .await
    })
    .await;
    assert!(crashed.unwrap_err().is_panic());
    // Not released because the caller went away: a duplicate is told it is in flight.
    let r = ctx
        .idem
        .operation("ship", "parcel-p")
        .in_flight(InFlight::Reject)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(1u64) })
        .await;
    assert!(matches!(r, Err(IdemError::InFlight { .. })), "{r:?}");
}

/// A body two leases long on `key`, and a waiting duplicate started once it runs;
/// returns how many bodies ran (1 when renewal kept the claim). Unrenewed, the claim
/// would lapse a lease before the body ends, for the polling duplicate to take over.
async fn slow_body_beside_a_duplicate(
    idem: &idem_runtime::Idem,
    key: &str,
    lease: Duration,
) -> usize {
    let runs = Counter::default();
    let (started_tx, started_rx) = oneshot::channel();
    let slow = {
        let (idem, runs, key) = (idem.clone(), runs.clone(), key.to_owned());
        tokio::spawn(async move {
            idem.operation("report", &key)
                .lease(lease)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    runs.hit();
                    let _ = started_tx.send(());
                    tokio::time::sleep(lease * 2).await;
                    Ok::<_, IdemError>("done".to_string())
                })
                .await
        })
    };
    started_rx.await.unwrap();
    let dup = idem
        .operation("report", key)
        .lease(lease)
        .in_flight(InFlight::Wait(Duration::from_secs(30)))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            runs.hit();
            Ok::<_, IdemError>("duplicate".to_string())
        })
        .await;
    assert_eq!(slow.await.unwrap().unwrap(), "done");
    assert_eq!(
        dup.unwrap(),
        "done",
        "the duplicate replays the slow body's outcome"
    );
    runs.get()
}

/// A memory store reached through the `Store` trait, as a store of the application's
/// own is: its claims are renewed from the handle's schedule. (`Idem::memory` pins its
/// claims instead, with nothing to renew.)
fn renewed_memory() -> idem_runtime::Idem {
    idem_runtime::Idem::builder().store(memory_through_trait())
}

/// One handle renews many live claims of different leases from its one schedule: no
/// duplicate takes any of them over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_live_bodies_are_renewed_from_one_schedule() {
    let idem = renewed_memory();
    let mut calls = Vec::new();
    for i in 0..16u64 {
        let idem = idem.clone();
        // Leases of 1 to 1.75 s, so due times interleave in the schedule; long enough
        // that a loaded machine's scheduling delays cannot lapse one between renewals.
        let lease = Duration::from_millis(1000 + 50 * i);
        calls.push(tokio::spawn(async move {
            slow_body_beside_a_duplicate(&idem, &format!("r-{i}"), lease).await
        }));
    }
    for c in calls {
        assert_eq!(c.await.unwrap(), 1, "a live body's claim was taken over");
    }
}

/// A short lease filed while the renewal task sleeps toward a long one's renewal wakes
/// it: the task would otherwise sleep past the short claim's lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_wakes_a_schedule_asleep_for_a_long_one() {
    let idem = renewed_memory();
    let (long, _) = start_pending(&idem, "long", Duration::from_secs(600)).await;
    // Let the renewal task file its sleep toward the long claim's renewal, 200 s away.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let runs = slow_body_beside_a_duplicate(&idem, "short", Duration::from_secs(1)).await;
    assert_eq!(
        runs, 1,
        "the short claim lapsed: the sleeping schedule was not woken"
    );
    long.abort();
}

/// A handle whose renewal task lives on a runtime that is not being driven still renews
/// a call on another runtime (that call renews on its own).
#[test]
fn a_call_on_another_runtime_is_renewed_there() {
    let idem = renewed_memory();
    let idle = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // A first call starts the handle's renewal task on `idle`, which then sits undriven.
    // Leased long enough that scheduling delays on a loaded machine cannot lapse it
    // between renewals.
    idle.block_on(slow_body_beside_a_duplicate(
        &idem,
        "first",
        Duration::from_secs(2),
    ));
    let busy = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let runs = busy.block_on(slow_body_beside_a_duplicate(
        &idem,
        "second",
        Duration::from_secs(1),
    ));
    assert_eq!(runs, 1, "the claim lapsed: nothing renewed it");
    drop(idle);
}

/// A handle outlives the runtime of its first calls: calls on the next runtime are
/// renewed there (the handle's renewal task ended with its runtime).
#[test]
fn calls_on_a_later_runtime_are_renewed() {
    let idem = renewed_memory();
    for round in 0..2 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let runs = rt.block_on(slow_body_beside_a_duplicate(
            &idem,
            &format!("round-{round}"),
            Duration::from_secs(1),
        ));
        assert_eq!(runs, 1, "round {round}: the claim lapsed");
    }
}

/// The memory store keeps leases as every store does: a body that stalls its runtime's
/// only thread for several leases (no renewal task can run there) loses its claim to a
/// duplicate from another thread, which runs at a higher epoch, and the stalled call's
/// record is fenced rather than written over the duplicate's. A test that passes on
/// `Idem::memory` holds on the stores it stands in for.
#[test]
fn a_stalled_runtime_loses_its_claim_on_the_memory_store_as_on_any_store() {
    let idem = idem_runtime::Idem::memory();
    let lease = Duration::from_millis(200);
    let runs = Counter::default();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let stalled = {
        let (idem, runs) = (idem.clone(), runs.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(
                idem.operation("stall", "s-1")
                    .lease(lease)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(move || async move {
                        runs.hit();
                        started_tx.send(()).unwrap();
                        // Waits once, so its claim is filed for renewal, then blocks the
                        // runtime's one thread until the duplicate has run.
                        tokio::task::yield_now().await;
                        done_rx.recv().unwrap();
                        Ok::<_, IdemError>("first".to_string())
                    }),
            )
        })
    };
    started_rx.recv().unwrap();
    // Three leases with no renewal possible on the stalled runtime.
    std::thread::sleep(lease * 3);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dup = rt.block_on(
        idem.operation("stall", "s-1")
            .lease(lease)
            .in_flight(InFlight::Reject)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                runs.hit();
                Ok::<_, IdemError>("second".to_string())
            }),
    );
    done_tx.send(()).unwrap();
    let first = stalled.join().unwrap();
    assert_eq!(runs.get(), 2, "the lapsed claim was not taken over");
    assert_eq!(dup.unwrap(), "second");
    assert!(
        matches!(first, Err(IdemError::Fenced { .. })),
        "the stalled call wrote over the taker's record: {first:?}"
    );
}
