//! The store suite's checks of the operator's calls ([`Admin`](crate::store::Admin)):
//! resolve, forget, purge, stats, list and get.

use std::time::Duration;

use super::{DAY, FP, LEASE, OTHER_FP, PAST_TINY, TINY, acquire, claim, fresh_id, outcome};
use crate::store::{Claim, Fence, ListFilter, OperationId, State, Store};

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

/// Purge removes COMPLETED records past retention, never claims in progress or UNKNOWN
/// records (released ones: `a_released_operation_expires`).
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

    // `a` was claimed at least 5 ms before `b`.
    let position =
        |rows: &[crate::store::RecordInfo], id: &OperationId| rows.iter().position(|r| &r.id == id);
    let mine = |rows: Vec<crate::store::RecordInfo>| -> Vec<crate::store::RecordInfo> {
        rows.into_iter()
            .filter(|r| r.id == a || r.id == b)
            .collect()
    };
    let newest = mine(
        store
            .list(&ListFilter::default().newest_first().limit(100_000))
            .await
            .unwrap(),
    );
    assert!(
        position(&newest, &b) < position(&newest, &a) && position(&newest, &a).is_some(),
        "newest first lists the later claim first: {newest:?}"
    );
    let oldest = mine(
        store
            .list(&ListFilter::default().limit(100_000))
            .await
            .unwrap(),
    );
    assert!(
        position(&oldest, &a) < position(&oldest, &b) && position(&oldest, &b).is_some(),
        "oldest first by default: {oldest:?}"
    );
    let recent = store
        .list(&ListFilter::recent(DAY).limit(100_000))
        .await
        .unwrap();
    assert!(
        position(&recent, &a).is_some() && position(&recent, &b).is_some(),
        "claims made now are newer than a day"
    );
    let just_now = store
        .list(&ListFilter::recent(Duration::from_millis(1)).limit(100_000))
        .await
        .unwrap();
    assert!(
        position(&just_now, &a).is_none(),
        "a claim 5 ms old is not newer than 1 ms: {just_now:?}"
    );
}
