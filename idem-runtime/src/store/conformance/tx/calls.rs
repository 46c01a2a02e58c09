//! Transactional checks of what one call answers: a commit replayed, a released error
//! and a rollback that leave nothing, a mismatch, a recorded error, an expired outcome
//! and an UNKNOWN operation.

use std::time::Duration;

use super::{DAY, Failure, TxDatabase, TxTarget, fresh, place, place_committed};
use crate::{Disposition, IdemError, TxStep};

/// A committed call writes once; the calls after it replay its answer.
pub async fn committed_once_then_replayed<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("once");
    for _ in 0..3 {
        let mut tx = t.begin().await;
        let (got, info) = crate::observe(place(t, &mut tx, &order, 3, false)).await;
        assert_eq!(got.unwrap(), 300);
        assert!(info.recorded(), "{info:?}");
        tx.commit().await.unwrap();
    }
    assert_eq!(
        t.rows(&order).await,
        [(order, 3)],
        "the body's write committed once"
    );
}

/// A released `Err` rolls the body's writes and the claim back to idem's savepoint,
/// even in a transaction the caller commits: the next call runs the body.
pub async fn released_error_keeps_neither_writes_nor_claim<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("released");
    let mut tx = t.begin().await;
    let r = place(t, &mut tx, &order, 1, true).await;
    assert!(matches!(r, Err(Failure::Timeout)), "{r:?}");
    tx.commit().await.unwrap();
    assert_eq!(t.rows(&order).await, [], "the body's write was rolled back");
    assert_eq!(
        place_committed(t, &order, 1).await.unwrap(),
        100,
        "the claim was released"
    );
    assert_eq!(t.rows(&order).await.len(), 1);
}

/// Rollback is the release: a rolled back call leaves no record, and the next call,
/// with another payload, runs.
pub async fn rolled_back_attempt_leaves_nothing<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("rolled");
    let mut tx = t.begin().await;
    place(t, &mut tx, &order, 2, false).await.unwrap();
    tx.rollback().await.unwrap();
    let id = t.idem.operation("place_order", order.as_str()).id().clone();
    assert_eq!(
        t.idem.get(&id).await.unwrap(),
        None,
        "a rolled back claim left a record"
    );
    assert_eq!(
        place_committed(t, &order, 5).await.unwrap(),
        500,
        "the key is free again"
    );
    assert_eq!(t.rows(&order).await, [(order, 5)]);
}

/// Another payload on a committed key is a mismatch inside a transaction too.
pub async fn mismatch_in_transaction<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("mismatch");
    place_committed(t, &order, 2).await.unwrap();
    let mut tx = t.begin().await;
    let r = place(t, &mut tx, &order, 9, false).await;
    assert!(
        matches!(r, Err(Failure::Idem(IdemError::Mismatch { .. }))),
        "{r:?}"
    );
    tx.rollback().await.unwrap();
}

/// With `errors = record`, a body whose own SQL failed (which aborts a PostgreSQL
/// transaction) still gets its error recorded and returned, never a store error in
/// its place; the next call replays it.
pub async fn recorded_error_after_the_body_sql_failed<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("sqlerr");
    let taken = format!("{order}#taken");
    let mut tx = t.begin().await;
    t.insert(&mut tx, &taken, 1).await.unwrap();
    tx.commit().await.unwrap();
    for attempt in 0..2 {
        let mut tx = t.begin().await;
        let op = t
            .idem
            .operation("place_order", order.as_str())
            .fingerprint(&2i64)
            .record_errors()
            .retain(DAY);
        let r: Result<i64, Failure> = match op.begin_tx(DB::tx(&mut tx)).await.unwrap() {
            TxStep::Replay(out) => {
                assert_eq!(attempt, 1, "replayed on the first call");
                out
            }
            TxStep::Run(guard) => {
                assert_eq!(attempt, 0, "ran again after the error was recorded");
                // A duplicate primary key: the body's own statement fails.
                let out = t
                    .insert(&mut tx, &taken, 2)
                    .await
                    .map(|()| 0)
                    .map_err(|_| Failure::Declined("duplicate order".into()));
                guard.finish(DB::tx(&mut tx), out).await
            }
        };
        assert!(
            matches!(&r, Err(Failure::Declined(m)) if m == "duplicate order"),
            "{r:?}"
        );
        tx.commit().await.unwrap();
    }
    assert_eq!(t.rows(&order).await, [(taken, 1)]);
}

/// An outcome past its retention is absent in transactional mode too: another
/// payload claims the key and runs.
pub async fn expired_outcome_is_claimed_afresh<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("expired");
    let recorded = t
        .idem
        .operation("place_order", order.as_str())
        .fingerprint(&1i64)
        .retain(Duration::from_millis(1))
        .run(|| async { Ok::<_, Failure>(100i64) })
        .await;
    assert_eq!(recorded.unwrap(), 100);
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(
        place_committed(t, &order, 2).await.unwrap(),
        200,
        "an expired outcome was answered"
    );
    assert_eq!(t.rows(&order).await, [(order, 2)]);
}

/// An UNKNOWN operation (a leased body's error classified unknown) is answered as
/// such in a transaction, at its epoch; the body does not run.
pub async fn unknown_is_answered_in_a_transaction<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("unknown");
    let (r, info) = crate::observe(
        t.idem
            .operation("place_order", order.as_str())
            .fingerprint(&1i64)
            .retain(DAY)
            .classify(|_: &Failure| Disposition::Unknown)
            .run(|| async { Err::<i64, _>(Failure::Timeout) }),
    )
    .await;
    assert!(matches!(r, Err(Failure::Timeout)), "{r:?}");
    assert!(info.unknown(), "{info:?}");
    let mut tx = t.begin().await;
    let r = place(t, &mut tx, &order, 1, false).await;
    assert!(
        matches!(r, Err(Failure::Idem(IdemError::Unknown { epoch, .. })) if Some(epoch) == info.epoch()),
        "{r:?}, the leased call ran at {:?}",
        info.epoch()
    );
    tx.rollback().await.unwrap();
    assert_eq!(t.rows(&order).await, []);
}
