//! The store suite's checks of claims and leases: a lease held for its full length, a
//! lapsed one taken over (or moved to UNKNOWN) and its epoch fenced, a release, and
//! epochs that never repeat.

use std::time::Duration;

use super::{
    DAY, FP, LEASE, OTHER_FP, PAST_TINY, TINY, acquire, claim, claim_with, fresh_id, outcome,
};
use crate::store::{Claim, Fence, Store, Takeover};

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
            ..
        } => epoch,
        other => panic!("a lapsed lease must be taken over, got {other:?}"),
    };
    assert!(new > old, "takeover epoch {new} must be above {old}");
    assert!(matches!(
        claim(store, &id, FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(store.renew(&id, old, LEASE).await.unwrap(), Fence::Lost);
    assert_eq!(store.release(&id, old, DAY).await.unwrap(), Fence::Lost);
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

/// A lease holds for its whole length from the moment its claim or renewal was sent,
/// which is what a caller counts on: a claim answered before then finds it in flight. A
/// store whose clock reads whole milliseconds rounds a lease's end up; rounded down, a
/// claim sent in the lease's last millisecond could take it over early.
///
/// Probes are claims sent ever closer to the lease's end; one answered after the end
/// proves nothing (the lease may have lapsed meanwhile) and the next is sent earlier.
pub async fn a_lease_holds_its_full_length(store: &dyn Store) {
    use tokio::time::Instant;
    const SHORT: Duration = Duration::from_millis(40);
    const PROBES: u32 = 16;
    // How long before the lease's end a probe is sent.
    let mut early = Duration::from_micros(500);
    let mut conclusive = 0;
    for attempt in 0..400 {
        if conclusive == PROBES {
            break;
        }
        let id = fresh_id("full-lease");
        let after_renewal = attempt % 2 == 1;
        let mut sent = Instant::now();
        let epoch = acquire(store, &id, FP, SHORT).await;
        if after_renewal {
            sent = Instant::now();
            let fence = store.renew(&id, epoch, SHORT).await.expect("renew");
            assert_eq!(fence, Fence::Held, "{id}: a live claim's renewal");
        }
        let end = sent + SHORT;
        let probe_at = end - early;
        if Instant::now() >= probe_at {
            early = (early * 2).min(SHORT / 2);
            continue;
        }
        // The timer to within a couple of milliseconds, then a spin to the instant.
        tokio::time::sleep_until(probe_at - Duration::from_millis(2)).await;
        while Instant::now() < probe_at {
            std::hint::spin_loop();
        }
        let probe = claim(store, &id, FP, SHORT).await;
        let answered = Instant::now();
        if answered >= end {
            early = (early * 2).min(SHORT / 2);
            continue;
        }
        conclusive += 1;
        assert!(
            matches!(probe, Claim::InFlight { .. }),
            "{id}: a claim answered {:?} before the end of a {SHORT:?} lease (sent \
             {:?} after its {}) took it over: {probe:?}",
            end - answered,
            probe_at - sent,
            if after_renewal { "renewal" } else { "claim" },
        );
        early = (early * 3 / 4).max(Duration::from_micros(50));
    }
    assert_eq!(
        conclusive, PROBES,
        "too few claims were answered before the lease's end to check it"
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

/// A released claim is absent: another payload then claims afresh.
pub async fn release_lets_the_next_call_run(store: &dyn Store) {
    let id = fresh_id("release");
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert_eq!(
        store.release(&id, epoch + 1, DAY).await.unwrap(),
        Fence::Lost
    );
    assert_eq!(store.release(&id, epoch, DAY).await.unwrap(), Fence::Held);
    assert_eq!(store.release(&id, epoch, DAY).await.unwrap(), Fence::Lost);
    acquire(store, &id, OTHER_FP, LEASE).await;
    assert_eq!(
        store.release(&id, u64::MAX, DAY).await.unwrap(),
        Fence::Lost
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
    assert_eq!(store.release(&id, second, DAY).await.unwrap(), Fence::Held);
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
