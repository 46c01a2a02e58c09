//! The store conformance suite: checks that any [`Store`] moves records through the
//! contract's states. Not a stable API.
//!
//! Each check takes a store and works on operation ids of its own (unique per call), so
//! the checks may share one store and run in any order. Each panics with a message
//! naming the transition that broke. A store's tests call [`run_all`]:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = idem_runtime::store::MemoryStore::default();
//! idem_runtime::store::conformance::run_all(&store).await;
//! # }
//! ```
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{
    Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, State, Store, StoredOutcome,
    Takeover,
};

const FP: [u8; 32] = [1; 32];
const OTHER_FP: [u8; 32] = [2; 32];
const LEASE: Duration = Duration::from_secs(60);
const TINY: Duration = Duration::from_millis(5);
/// Comfortably past [`TINY`] by any store's clock.
const PAST_TINY: Duration = Duration::from_millis(60);
const DAY: Duration = Duration::from_secs(86_400);

/// An operation id no other check (and no earlier run on a durable store) uses.
fn fresh_id(check: &str) -> OperationId {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    OperationId {
        scope: "conformance".into(),
        name: check.into(),
        key: format!("{}-{nanos}-{n}", std::process::id()),
    }
}

fn outcome(body: &str) -> StoredOutcome {
    StoredOutcome {
        is_err: false,
        version: 1,
        body: body.as_bytes().to_vec(),
    }
}

async fn claim_with(
    store: &dyn Store,
    id: &OperationId,
    fp: [u8; 32],
    lease: Duration,
    on_takeover: Takeover,
) -> Claim {
    let req = ClaimRequest {
        id,
        fingerprint: fp,
        lease,
        on_takeover,
    };
    store.claim(&req).await.expect("claim")
}

async fn claim(store: &dyn Store, id: &OperationId, fp: [u8; 32], lease: Duration) -> Claim {
    claim_with(store, id, fp, lease, Takeover::Rerun).await
}

/// Claims `id` afresh and returns the epoch; panics on anything but a fresh claim.
async fn acquire(store: &dyn Store, id: &OperationId, fp: [u8; 32], lease: Duration) -> u64 {
    match claim(store, id, fp, lease).await {
        Claim::Acquired {
            epoch,
            takeover: false,
        } => epoch,
        other => panic!("{id}: expected a fresh claim, got {other:?}"),
    }
}

/// Every check below, in turn.
pub async fn run_all(store: &dyn Store) {
    fresh_claim_in_flight_then_replay(store).await;
    mismatch_in_every_state(store).await;
    lapsed_lease_is_taken_over_and_fenced(store).await;
    lapsed_lease_goes_unknown(store).await;
    resolve_records_or_removes(store).await;
    forget_drops_settled_records_only(store).await;
    release_lets_the_next_call_run(store).await;
    expired_is_claimed_afresh(store).await;
    epochs_never_repeat(store).await;
    purge_removes_only_expired_completed(store).await;
    stats_and_list(store).await;
}

/// ABSENT → IN_PROGRESS → COMPLETED; duplicates see in-flight, then the outcome; a
/// record retried after its reply was lost holds, another outcome does not.
pub async fn fresh_claim_in_flight_then_replay(store: &dyn Store) {
    let id = fresh_id("replay");
    let epoch = acquire(store, &id, FP, LEASE).await;
    match claim(store, &id, FP, LEASE).await {
        Claim::InFlight { retry_after } => assert!(retry_after <= LEASE, "{retry_after:?}"),
        other => panic!("a live claim must be in flight, got {other:?}"),
    }
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    let done = StoredOutcome {
        is_err: true,
        version: 3,
        body: b"{\"declined\":true}".to_vec(),
    };
    assert_eq!(
        store.record(&id, epoch, &done, DAY).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(done.clone())
    );
    if let Ok(detail) = store.get(&id).await {
        let detail = detail.expect("get finds the record");
        assert_eq!(detail.info.state, State::Completed);
        assert_eq!(detail.outcome.as_ref(), Some(&done));
        assert!(detail.expires_in.is_some_and(|d| d <= DAY && d > DAY / 2));
    }
    if let Some(peeked) = store.peek_completed(&id, &FP).await.unwrap() {
        assert_eq!(peeked, Ok(done.clone()), "peek must return the outcome");
    }
    assert_eq!(
        store.record(&id, epoch, &done, DAY).await.unwrap(),
        Fence::Held,
        "the same record retried must hold"
    );
    assert_eq!(
        store.record(&id, epoch, &outcome("2"), DAY).await.unwrap(),
        Fence::Lost,
        "another outcome over a completed record must be fenced"
    );
}

/// Another fingerprint is a mismatch whatever the state, and never takes over.
pub async fn mismatch_in_every_state(store: &dyn Store) {
    let id = fresh_id("mismatch");
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert_eq!(claim(store, &id, OTHER_FP, LEASE).await, Claim::Mismatch);
    store.record(&id, epoch, &outcome("1"), DAY).await.unwrap();
    assert_eq!(claim(store, &id, OTHER_FP, LEASE).await, Claim::Mismatch);
    if let Some(peeked) = store.peek_completed(&id, &OTHER_FP).await.unwrap() {
        assert_eq!(peeked, Err(Mismatched));
    }

    let unknown = fresh_id("mismatch");
    let epoch = acquire(store, &unknown, FP, LEASE).await;
    assert_eq!(
        store.mark_unknown(&unknown, epoch).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &unknown, OTHER_FP, LEASE).await,
        Claim::Mismatch
    );
    assert_eq!(
        claim(store, &unknown, FP, LEASE).await,
        Claim::Unknown { epoch, now: false }
    );

    let lapsed = fresh_id("mismatch");
    acquire(store, &lapsed, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(
        claim(store, &lapsed, OTHER_FP, LEASE).await,
        Claim::Mismatch
    );
}

/// A lapsed lease is taken over at a higher epoch; every write of the old epoch is
/// fenced, the new one's hold.
pub async fn lapsed_lease_is_taken_over_and_fenced(store: &dyn Store) {
    let id = fresh_id("takeover");
    let old = acquire(store, &id, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    let new = match claim(store, &id, FP, LEASE).await {
        Claim::Acquired {
            epoch,
            takeover: true,
        } => epoch,
        other => panic!("a lapsed lease must be taken over, got {other:?}"),
    };
    assert!(new > old, "takeover epoch {new} must be above {old}");
    assert!(matches!(
        claim(store, &id, FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(store.renew(&id, old, LEASE).await.unwrap(), Fence::Lost);
    assert_eq!(store.release(&id, old).await.unwrap(), Fence::Lost);
    assert_eq!(store.mark_unknown(&id, old).await.unwrap(), Fence::Lost);
    assert_eq!(
        store.record(&id, old, &outcome("late"), DAY).await.unwrap(),
        Fence::Lost,
        "a late finisher must be fenced"
    );
    assert_eq!(store.renew(&id, new, LEASE).await.unwrap(), Fence::Held);
    assert_eq!(
        store.record(&id, new, &outcome("ok"), DAY).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(outcome("ok"))
    );
}

/// Under `Takeover::Unknown` a lapsed lease goes to UNKNOWN at the same epoch; only
/// `resolve` moves it on.
pub async fn lapsed_lease_goes_unknown(store: &dyn Store) {
    let id = fresh_id("to-unknown");
    let epoch = acquire(store, &id, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    let to_unknown = |store| claim_with(store, &id, FP, LEASE, Takeover::Unknown);
    assert_eq!(to_unknown(store).await, Claim::Unknown { epoch, now: true });
    assert_eq!(
        to_unknown(store).await,
        Claim::Unknown { epoch, now: false }
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Unknown { epoch, now: false }
    );
    assert_eq!(
        store
            .record(&id, epoch, &outcome("late"), DAY)
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        store.resolve(&id, epoch + 1, None).await.unwrap(),
        Fence::Lost
    );
    assert_eq!(store.resolve(&id, epoch, None).await.unwrap(), Fence::Held);
    let again = acquire(store, &id, FP, LEASE).await;
    assert_ne!(again, epoch);
}

/// `resolve` with an outcome completes an UNKNOWN record; without one it removes it.
pub async fn resolve_records_or_removes(store: &dyn Store) {
    let id = fresh_id("resolve");
    let epoch = acquire(store, &id, FP, LEASE).await;
    store.mark_unknown(&id, epoch).await.unwrap();
    let settled = outcome("\"settled\"");
    assert_eq!(
        store
            .resolve(&id, epoch, Some((&settled, DAY)))
            .await
            .unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(settled)
    );
    assert_eq!(
        store.resolve(&id, epoch, None).await.unwrap(),
        Fence::Lost,
        "a completed record cannot be resolved"
    );
}

/// `forget` deletes a COMPLETED or UNKNOWN record and a lapsed claim, fenced by the
/// epoch; never a claim whose lease holds. A forgotten operation is absent: another
/// payload claims it afresh, at an epoch never used before.
pub async fn forget_drops_settled_records_only(store: &dyn Store) {
    // COMPLETED, say by a mistaken resolve: forgotten, the next call runs.
    let id = fresh_id("forget");
    let epoch = acquire(store, &id, FP, LEASE).await;
    store.mark_unknown(&id, epoch).await.unwrap();
    let wrong = outcome("\"wrong\"");
    store
        .resolve(&id, epoch, Some((&wrong, DAY)))
        .await
        .unwrap();
    assert_eq!(
        store.forget(&id, epoch + 1).await.unwrap(),
        Fence::Lost,
        "forget at another epoch"
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(wrong.clone()),
        "a fenced forget deleted nothing"
    );
    assert_eq!(store.forget(&id, epoch).await.unwrap(), Fence::Held);
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    if let Ok(detail) = store.get(&id).await {
        assert_eq!(detail, None, "a forgotten record is gone");
    }
    assert_eq!(
        store.forget(&id, epoch).await.unwrap(),
        Fence::Lost,
        "forget twice"
    );
    let next = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(next > epoch, "epoch {next} after a forget of {epoch}");
    assert_eq!(
        store
            .record(&id, epoch, &outcome("late"), DAY)
            .await
            .unwrap(),
        Fence::Lost
    );

    // IN_PROGRESS under a live lease: refused, the claim stands.
    assert_eq!(store.forget(&id, next).await.unwrap(), Fence::Lost);
    assert!(matches!(
        claim(store, &id, OTHER_FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(
        store.record(&id, next, &outcome("ok"), DAY).await.unwrap(),
        Fence::Held
    );

    // UNKNOWN, and a claim whose lease lapsed.
    let unknown = fresh_id("forget");
    let u = acquire(store, &unknown, FP, LEASE).await;
    store.mark_unknown(&unknown, u).await.unwrap();
    assert_eq!(store.forget(&unknown, u).await.unwrap(), Fence::Held);
    acquire(store, &unknown, OTHER_FP, LEASE).await;
    let lapsed = fresh_id("forget");
    let l = acquire(store, &lapsed, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(store.forget(&lapsed, l).await.unwrap(), Fence::Held);
    assert!(matches!(
        claim(store, &lapsed, OTHER_FP, LEASE).await,
        Claim::Acquired {
            takeover: false,
            ..
        }
    ));
}

/// A released claim is absent: another payload then claims afresh.
pub async fn release_lets_the_next_call_run(store: &dyn Store) {
    let id = fresh_id("release");
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert_eq!(store.release(&id, epoch + 1).await.unwrap(), Fence::Lost);
    assert_eq!(store.release(&id, epoch).await.unwrap(), Fence::Held);
    assert_eq!(store.release(&id, epoch).await.unwrap(), Fence::Lost);
    acquire(store, &id, OTHER_FP, LEASE).await;
    assert_eq!(store.release(&id, u64::MAX).await.unwrap(), Fence::Lost);
}

/// An expired outcome is absent: a new payload binds, and the old epoch is fenced.
pub async fn expired_is_claimed_afresh(store: &dyn Store) {
    let id = fresh_id("expired");
    let old = acquire(store, &id, FP, LEASE).await;
    store
        .record(&id, old, &outcome("old"), Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    let new = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(new > old);
    assert_eq!(claim(store, &id, FP, LEASE).await, Claim::Mismatch);
    assert_eq!(
        store
            .record(&id, old, &outcome("stale"), DAY)
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        store.record(&id, new, &outcome("new"), DAY).await.unwrap(),
        Fence::Held
    );
}

/// A fence identifies one claim for all time: after a release, an operator's retry or
/// a purge removed the record, the next claim's epoch differs from every earlier one,
/// so a late finisher of an earlier claim stays fenced.
pub async fn epochs_never_repeat(store: &dyn Store) {
    let id = fresh_id("epochs");
    let mut seen = Vec::new();
    // A stalled first claim, taken over.
    let first = acquire(store, &id, FP, TINY).await;
    seen.push(first);
    tokio::time::sleep(PAST_TINY).await;
    let Claim::Acquired { epoch: second, .. } = claim(store, &id, FP, LEASE).await else {
        panic!("takeover expected");
    };
    seen.push(second);
    // The taker releases: the record is gone.
    assert_eq!(store.release(&id, second).await.unwrap(), Fence::Held);
    let third = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(
        !seen.contains(&third),
        "epoch {third} reused after a release ({seen:?})"
    );
    seen.push(third);
    // The stalled first owner wakes up: every write of its epoch is fenced.
    assert_eq!(store.renew(&id, first, LEASE).await.unwrap(), Fence::Lost);
    assert_eq!(
        store
            .record(&id, first, &outcome("late"), DAY)
            .await
            .unwrap(),
        Fence::Lost,
        "a late finisher passed the fence of a newer claim"
    );
    // An operator's retry removes the record too.
    store.mark_unknown(&id, third).await.unwrap();
    assert_eq!(store.resolve(&id, third, None).await.unwrap(), Fence::Held);
    let fourth = acquire(store, &id, FP, LEASE).await;
    assert!(
        !seen.contains(&fourth),
        "epoch {fourth} reused after a resolve ({seen:?})"
    );
    seen.push(fourth);
    for old in &seen[..3] {
        assert_eq!(store.renew(&id, *old, LEASE).await.unwrap(), Fence::Lost);
    }
    // And a purge of an expired outcome.
    store
        .record(&id, fourth, &outcome("done"), Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(PAST_TINY).await;
    store.purge_expired().await.unwrap();
    let fifth = acquire(store, &id, FP, LEASE).await;
    assert!(
        !seen.contains(&fifth),
        "epoch {fifth} reused after a purge ({seen:?})"
    );
    for old in &seen {
        assert_eq!(
            store
                .record(&id, *old, &outcome("late"), DAY)
                .await
                .unwrap(),
            Fence::Lost
        );
    }
}

/// Purge removes COMPLETED records past retention, never IN_PROGRESS or UNKNOWN ones.
pub async fn purge_removes_only_expired_completed(store: &dyn Store) {
    let live = fresh_id("purge");
    let expired = fresh_id("purge");
    let running = fresh_id("purge");
    let unknown = fresh_id("purge");
    let lapsed = fresh_id("purge");
    let e = acquire(store, &live, FP, LEASE).await;
    store.record(&live, e, &outcome("1"), DAY).await.unwrap();
    let e = acquire(store, &expired, FP, LEASE).await;
    store
        .record(&expired, e, &outcome("1"), Duration::from_millis(1))
        .await
        .unwrap();
    acquire(store, &running, FP, LEASE).await;
    let u = acquire(store, &unknown, FP, LEASE).await;
    store.mark_unknown(&unknown, u).await.unwrap();
    acquire(store, &lapsed, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;

    assert!(store.purge_expired().await.unwrap() >= 1);
    assert_eq!(store.purge_expired().await.unwrap(), 0, "purge twice");
    assert_eq!(
        claim(store, &live, FP, LEASE).await,
        Claim::Completed(outcome("1"))
    );
    assert!(matches!(
        claim(store, &running, FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(
        claim(store, &unknown, FP, LEASE).await,
        Claim::Unknown {
            epoch: u,
            now: false
        }
    );
    // The lapsed claim survived the purge: it is taken over, not claimed afresh.
    assert!(matches!(
        claim(store, &lapsed, FP, LEASE).await,
        Claim::Acquired { takeover: true, .. }
    ));
    // The expired one is gone or claimable afresh.
    acquire(store, &expired, OTHER_FP, LEASE).await;
}

/// `stats` counts by state; `list` filters by state and name, oldest first.
pub async fn stats_and_list(store: &dyn Store) {
    let before = store.stats().await.unwrap();
    let a = fresh_id("list-a");
    let b = fresh_id("list-b");
    acquire(store, &a, FP, LEASE).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let eb = acquire(store, &b, FP, LEASE).await;
    store.mark_unknown(&b, eb).await.unwrap();
    let after = store.stats().await.unwrap();
    assert!(after.in_progress > before.in_progress);
    assert!(after.unknown > before.unknown);
    assert!(after.oldest_in_progress.is_some() && after.oldest_unknown.is_some());

    let all = |name: &str, state| ListFilter {
        name: Some(name.into()),
        state,
        limit: Some(1000),
        ..Default::default()
    };
    if let Ok(detail) = store.get(&b).await {
        let detail = detail.expect("get finds the record");
        assert_eq!((detail.info.state, detail.info.epoch), (State::Unknown, eb));
        assert_eq!(detail.outcome, None);
        assert_eq!(store.get(&fresh_id("absent")).await.unwrap(), None);
    }
    let rows = store
        .list(&all("list-b", Some(State::Unknown)))
        .await
        .unwrap();
    let row = rows
        .iter()
        .find(|r| r.id == b)
        .expect("UNKNOWN record listed");
    assert_eq!((row.state, row.epoch), (State::Unknown, eb));
    let rows = store.list(&all("list-a", None)).await.unwrap();
    assert!(
        rows.iter()
            .any(|r| r.id == a && r.state == State::InProgress)
    );
    assert!(
        rows.iter().all(|r| r.id.name == "list-a"),
        "the name filter leaked"
    );
    let stuck = store.list(&ListFilter::stuck(DAY)).await.unwrap();
    assert!(
        !stuck.iter().any(|r| r.id == a),
        "a new claim is not stuck for a day"
    );
    let scoped = |scope: &str| ListFilter {
        name: Some("list-a".into()),
        scope: Some(scope.into()),
        limit: Some(1000),
        ..Default::default()
    };
    let rows = store.list(&scoped(&a.scope)).await.unwrap();
    assert!(rows.iter().any(|r| r.id == a), "listed in its own scope");
    let rows = store.list(&scoped("another scope")).await.unwrap();
    assert!(rows.is_empty(), "the scope filter leaked: {rows:?}");
    let one = ListFilter {
        limit: Some(1),
        ..Default::default()
    };
    assert_eq!(store.list(&one).await.unwrap().len(), 1);
}
