//! Transactional checks of claims within one transaction: a claim the body rolled back,
//! a record fenced by its claim's epoch, a second claim of a held key, nested
//! operations, and the running operation seen from the body.

use std::time::Duration;

use sqlx::Transaction;

use super::{DAY, Failure, TxDatabase, TxTarget, claim, fresh, place};
use crate::{Idem, IdemError, TxConnection, TxStep};

/// A body that rolls back to its operation's savepoint (`idem_body_<n>`) takes the
/// claim with it: its `Ok` is refused with a `Config` error naming that savepoint,
/// never answered as if recorded (a commit and a retry would then run the body twice).
pub async fn a_claim_the_body_rolled_back_is_refused<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("undone");
    let mut tx = t.begin().await;
    let TxStep::Run(guard) = claim(t, &mut tx, &order, 1).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    let savepoint = guard.savepoint().to_owned();
    DB::execute(&mut *tx, format!("ROLLBACK TO SAVEPOINT {savepoint}"))
        .await
        .unwrap();
    t.insert(&mut tx, &order, 1).await.unwrap();
    let r = guard.finish(DB::tx(&mut tx), Ok::<_, Failure>(7)).await;
    let named = format!("savepoint `{savepoint}`");
    assert!(
        matches!(&r, Err(Failure::Idem(IdemError::Config { message }))
            if message.contains("vanished") && message.contains(&named)),
        "{r:?}"
    );
    tx.rollback().await.unwrap();
}

/// A record is fenced by its claim's epoch: once the key was claimed again at
/// another epoch (here by the same transaction, taking over the first claim's lapsed
/// lease), the first claim's guard records nothing and is refused, and the second's
/// records.
pub async fn a_record_is_fenced_by_its_claims_epoch<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("fenced");
    let lease = Duration::from_millis(50);
    let claim_leased = async |tx: &mut Transaction<'static, DB>| {
        let op = t
            .idem
            .operation("place_order", order.as_str())
            .fingerprint(&1i64)
            .lease(lease)
            .retain(DAY);
        match op.begin_tx::<_, i64, Failure>(DB::tx(tx)).await.unwrap() {
            TxStep::Run(guard) => guard,
            TxStep::Replay(_) => panic!("a claim in progress replayed"),
        }
    };
    let epoch =
        async |guard: &crate::TxGuard<_, _>| guard.body(async { crate::current().epoch() }).await;
    let mut tx = t.begin().await;
    let first = claim_leased(&mut tx).await;
    tokio::time::sleep(lease * 3).await;
    let second = claim_leased(&mut tx).await;
    let (old, new) = (epoch(&first).await, epoch(&second).await);
    assert!(new > old, "the takeover's epoch {new} is not above {old}");
    let r = first.finish(DB::tx(&mut tx), Ok::<_, Failure>(1)).await;
    assert!(
        matches!(&r, Err(Failure::Idem(IdemError::Config { message })) if message.contains("vanished")),
        "the first claim's guard recorded over the second claim: {r:?}"
    );
    assert_eq!(
        second
            .finish(DB::tx(&mut tx), Ok::<_, Failure>(2))
            .await
            .unwrap(),
        2
    );
    tx.commit().await.unwrap();
    let mut tx = t.begin().await;
    assert!(matches!(
        claim(t, &mut tx, &order, 1).await,
        Ok(TxStep::Replay(Ok(2)))
    ));
    tx.rollback().await.unwrap();
}

/// A transaction claiming a key it already holds is told the operation is running,
/// and the claim it holds still records; the rollback releases both.
pub async fn a_second_claim_in_the_same_transaction_is_in_flight<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("twice");
    let mut tx = t.begin().await;
    let TxStep::Run(guard) = claim(t, &mut tx, &order, 1).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    let again = claim(t, &mut tx, &order, 1).await;
    assert!(
        matches!(again, Err(IdemError::InFlight { .. })),
        "{:?}",
        again.err()
    );
    let r = guard.finish(DB::tx(&mut tx), Ok::<_, Failure>(1)).await;
    assert!(
        matches!(r, Ok(1)),
        "the claim held did not record after a refused second claim: {r:?}"
    );
    tx.rollback().await.unwrap();
    let mut tx = t.begin().await;
    assert!(
        matches!(claim(t, &mut tx, &order, 1).await, Ok(TxStep::Run(_))),
        "the key stayed claimed"
    );
    tx.rollback().await.unwrap();
}

/// Operations nested in one transaction (an idempotent function calling another
/// with the same transaction) each record, and an inner released error rolls back
/// only the inner body's writes; an operation also records after a second claim of
/// its own key was refused in its transaction.
pub async fn nested_operations_in_one_transaction_each_record<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let (outer, inner, failed) = (fresh("outer"), fresh("inner"), fresh("failed"));
    let mut tx = t.begin().await;
    let TxStep::Run(outer_guard) = claim(t, &mut tx, &outer, 1).await.unwrap() else {
        panic!("a fresh key replayed");
    };
    t.insert(&mut tx, &outer, 1).await.unwrap();
    assert_eq!(place(t, &mut tx, &inner, 2, false).await.unwrap(), 200);
    let r = place(t, &mut tx, &failed, 3, true).await;
    assert!(matches!(r, Err(Failure::Timeout)), "{r:?}");
    let again = claim(t, &mut tx, &outer, 1).await;
    assert!(
        matches!(again, Err(IdemError::InFlight { .. })),
        "{:?}",
        again.err()
    );
    let r = outer_guard
        .finish(DB::tx(&mut tx), Ok::<_, Failure>(100))
        .await;
    match r {
        Ok(v) => assert_eq!(v, 100),
        Err(e) => panic!("the outer operation did not record after inner ones: {e:?}"),
    }
    tx.commit().await.unwrap();
    assert_eq!(
        t.rows(&outer).await,
        [(outer.clone(), 1)],
        "the outer body's write"
    );
    assert_eq!(
        t.rows(&inner).await,
        [(inner.clone(), 2)],
        "the inner body's write"
    );
    assert_eq!(t.rows(&failed).await, [], "the failed inner body's write");
    let mut tx = t.begin().await;
    assert_eq!(place(t, &mut tx, &outer, 1, false).await.unwrap(), 100);
    assert_eq!(place(t, &mut tx, &inner, 2, false).await.unwrap(), 200);
    assert_eq!(
        place(t, &mut tx, &failed, 3, false).await.unwrap(),
        300,
        "the failed inner operation's claim was released"
    );
    tx.rollback().await.unwrap();
}

// The attribute in transactional mode, generic over the transaction type.
#[crate::idempotent(crate = crate, store = idem, key = order, retain = "1d", tx = tx, name = "ship")]
async fn ship<C: TxConnection>(
    idem: &Idem,
    tx: &mut C,
    order: &str,
) -> Result<(u64, String), Failure> {
    let _ = &tx;
    let cur = crate::current();
    Ok((cur.epoch(), cur.downstream_key("carrier")))
}

/// The running operation is visible in a transactional body, as in a leased one, at
/// the epoch its claim holds; not after it.
pub async fn current_is_set_in_a_transactional_body<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let order = fresh("current");
    let mut tx = t.begin().await;
    let (epoch, key) = ship(&t.idem, DB::tx(&mut tx), &order).await.unwrap();
    tx.commit().await.unwrap();
    assert!(crate::try_current().is_none());
    assert_eq!(key.len(), 64);
    let id = t.idem.operation("ship", order.as_str()).id().clone();
    let record = t
        .idem
        .get(&id)
        .await
        .unwrap()
        .expect("the call was recorded");
    assert_eq!(
        record.info.epoch, epoch,
        "current() saw another epoch than its claim's"
    );
}
