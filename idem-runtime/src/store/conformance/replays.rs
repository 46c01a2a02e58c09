//! The store suite's checks of records and replays: a claim in flight, then its
//! outcome replayed; another request's mismatch; an expired outcome claimed afresh.

use std::time::Duration;

use super::{DAY, FP, LEASE, OTHER_FP, PAST_TINY, TINY, acquire, claim, fresh_id, outcome};
use crate::store::{Claim, Fence, Mismatched, State, Store, StoredOutcome};

/// ABSENT → IN_PROGRESS → COMPLETED; duplicates see in-flight, then the outcome; a
/// record retried after its reply was lost holds, another outcome does not.
pub async fn fresh_claim_in_flight_then_replay(store: &dyn Store) {
    let id = fresh_id("replay");
    let epoch = acquire(store, &id, FP, LEASE).await;
    match claim(store, &id, FP, LEASE).await {
        // A store with a millisecond clock holds a lease up to 2 ms past its length.
        Claim::InFlight { retry_after } => assert!(
            retry_after <= LEASE + Duration::from_millis(2),
            "{retry_after:?}"
        ),
        other => panic!("a live claim must be in flight, got {other:?}"),
    }
    if let Ok(Some(detail)) = store.get(&id).await {
        let left = detail.lease_remaining;
        assert!(
            left.is_some_and(|l| l > Duration::ZERO && l <= LEASE + Duration::from_millis(2)),
            "a fresh claim of a {LEASE:?} lease shows {left:?} of it left"
        );
    }
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    let done = StoredOutcome {
        is_err: true,
        version: 3,
        body: b"{\"declined\":true}".as_slice().into(),
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
    assert!(
        matches!(
            claim(store, &id, OTHER_FP, LEASE).await,
            Claim::InFlight { .. }
        ),
        "the new life's claim holds its lease"
    );
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
