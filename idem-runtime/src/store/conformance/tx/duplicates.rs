//! Transactional checks of duplicates: one waiting for the transaction that holds the
//! claim, one reading from an older snapshot, many at once, and a claim abandoned in a
//! committed transaction.

use std::sync::Arc;
use std::time::Duration;

use super::{DAY, Failure, TxDatabase, TxTarget, claim, fresh, place, place_committed};
use crate::{IdemError, TxStep};

/// A duplicate waits for the transaction holding the claim: once that commits it
/// replays the outcome; once that rolls back it claims and runs, even with another
/// payload.
pub async fn a_duplicate_waits_for_the_first_transaction<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let duplicate = |order: String, qty| {
        let t = t.clone();
        tokio::spawn(async move {
            let mut tx = t.begin().await;
            let (out, info) = crate::observe(place(&t, &mut tx, &order, qty, false)).await;
            tx.commit().await.unwrap();
            (out.unwrap(), info.replayed())
        })
    };
    // Long enough that a duplicate not waiting would have answered.
    let wait = Duration::from_millis(200);

    let committed = fresh("waitc");
    let mut first = t.begin().await;
    let TxStep::Run(guard) = claim(t, &mut first, &committed, 1).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    let second = duplicate(committed.clone(), 1);
    tokio::time::sleep(wait).await;
    assert!(
        !second.is_finished(),
        "a duplicate answered while the claim was uncommitted"
    );
    t.insert(&mut first, &committed, 1).await.unwrap();
    assert_eq!(
        guard
            .finish(DB::tx(&mut first), Ok::<_, Failure>(100))
            .await
            .unwrap(),
        100
    );
    first.commit().await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        (100, true),
        "the duplicate replays the commit"
    );
    assert_eq!(t.rows(&committed).await.len(), 1);

    let rolled = fresh("waitr");
    let mut first = t.begin().await;
    let TxStep::Run(_guard) = claim(t, &mut first, &rolled, 1).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    let second = duplicate(rolled.clone(), 2);
    tokio::time::sleep(wait).await;
    assert!(
        !second.is_finished(),
        "a duplicate answered while the claim was uncommitted"
    );
    first.rollback().await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        (200, false),
        "the duplicate runs after a rollback"
    );
    assert_eq!(t.rows(&rolled).await, [(rolled, 2)]);
}

/// A duplicate whose snapshot was taken before the first transaction committed never
/// runs the body again: it replays, or (PostgreSQL's REPEATABLE READ, a deferred
/// SQLite transaction) fails with a retryable error, and the retried transaction
/// replays.
pub async fn a_duplicate_from_an_older_snapshot_retries_or_replays<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("snapshot");
    let mut first = t.begin().await;
    let TxStep::Run(guard) = claim(t, &mut first, &order, 1).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    let (snapshot_taken, snapshot) = tokio::sync::oneshot::channel();
    let (committed, commit) = tokio::sync::oneshot::channel::<()>();
    let second = {
        let (t, order) = (t.clone(), order.clone());
        tokio::spawn(async move {
            let mut tx = t.begin_snapshot().await;
            // The first read takes the snapshot, before the first transaction commits.
            let read = format!("SELECT count(*) FROM {}", t.table);
            DB::execute(&mut *tx, read).await.unwrap();
            snapshot_taken.send(()).unwrap();
            commit.await.unwrap();
            let answer = match claim(&t, &mut tx, &order, 1).await {
                Ok(TxStep::Replay(out)) => Ok(out.unwrap()),
                Ok(TxStep::Run(_)) => panic!("a duplicate claimed a committed operation"),
                Err(e) => Err(e),
            };
            let _ = tx.rollback().await;
            answer
        })
    };
    snapshot.await.unwrap();
    t.insert(&mut first, &order, 1).await.unwrap();
    assert_eq!(
        guard
            .finish(DB::tx(&mut first), Ok::<_, Failure>(100))
            .await
            .unwrap(),
        100
    );
    first.commit().await.unwrap();
    committed.send(()).unwrap();
    match second.await.unwrap() {
        Ok(v) => assert_eq!(v, 100),
        Err(e) => assert!(e.is_retryable(), "not retryable: {e}"),
    }
    assert_eq!(place_committed(t, &order, 1).await.unwrap(), 100);
    assert_eq!(t.rows(&order).await.len(), 1);
}

/// Callers released together on the same keys, each retrying its whole transaction
/// on a retryable error (a serialization failure, a deadlock): each key is written
/// once, and every caller answered its outcome.
pub async fn concurrent_duplicates_write_once<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    const KEYS: usize = 50;
    const CALLERS: usize = 4;
    let base = fresh("conc");
    let barrier = Arc::new(tokio::sync::Barrier::new(KEYS * CALLERS));
    let tasks: Vec<_> = (0..KEYS * CALLERS)
        .map(|i| {
            let (t, barrier) = (t.clone(), barrier.clone());
            let order = format!("{base}#{}", i % KEYS);
            tokio::spawn(async move {
                barrier.wait().await;
                for _ in 0..50 {
                    let mut tx = t.begin().await;
                    match place(&t, &mut tx, &order, 1, false).await {
                        Ok(v) => {
                            if tx.commit().await.is_ok() {
                                return v;
                            }
                        }
                        Err(Failure::Idem(e)) if e.is_retryable() => {}
                        Err(e) => panic!("{e:?}"),
                    }
                }
                panic!("no attempt committed");
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap(), 100);
    }
    assert_eq!(t.rows(&base).await.len(), KEYS);
}

/// A claim whose body was cancelled (no finish) in a transaction the caller then
/// committed holds while its lease runs (a duplicate is told it is already running)
/// and lapses after it: a transactional or a leased call then takes it over, so the
/// key is never blocked for good.
pub async fn abandoned_claim_is_taken_over_after_its_lease<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let abandon = async |order: &str, lease| {
        let mut tx = t.begin().await;
        let op = t
            .idem
            .operation("place_order", order)
            .fingerprint(&1i64)
            .lease(lease)
            .retain(DAY);
        match op
            .begin_tx::<_, i64, Failure>(DB::tx(&mut tx))
            .await
            .unwrap()
        {
            TxStep::Run(guard) => drop(guard),
            TxStep::Replay(_) => panic!("a fresh key replayed"),
        }
        tx.commit().await.unwrap();
    };
    let lease = Duration::from_millis(300);
    let past_lease = lease + Duration::from_millis(200);
    let short = fresh("abandon");
    abandon(&short, lease).await;
    // Within the lease a duplicate is refused: shown on a claim leased for a minute,
    // so no slow commit or claim can see it lapse first.
    let long = fresh("abandonl");
    abandon(&long, Duration::from_secs(60)).await;
    let mut tx = t.begin().await;
    let r = place(t, &mut tx, &long, 1, false).await;
    assert!(
        matches!(r, Err(Failure::Idem(IdemError::InFlight { .. }))),
        "{r:?}"
    );
    tx.rollback().await.unwrap();
    // Past the lease the short claim is taken over (any later, all the more).
    tokio::time::sleep(past_lease).await;
    assert_eq!(place_committed(t, &short, 1).await.unwrap(), 100);
    assert_eq!(t.rows(&short).await.len(), 1);

    let leased = fresh("abandonr");
    abandon(&leased, lease).await;
    tokio::time::sleep(past_lease).await;
    let (v, info) = crate::observe(
        t.idem
            .operation("place_order", leased.as_str())
            .fingerprint(&1i64)
            .retain(DAY)
            .run(|| async { Ok::<_, Failure>(7i64) }),
    )
    .await;
    assert_eq!(v.unwrap(), 7);
    assert!(
        info.epoch().is_some(),
        "the leased call did not run the body"
    );
}
