//! New claims rate-limited apart from replays (`IdemBuilder::limit_new_claims`), on every
//! store: a principal flooding new keys at ten times its allowance gets exactly its
//! allowance run, the rest refused with nothing recorded, while its replays and another
//! principal's calls keep their answers; a duplicate of a call in flight is answered as
//! one, never refused; a shared count is one allowance across instances.
use crate::common;
use crate::suite;

use std::time::Duration;

use common::{Backend, Counter, Ctx};
use idem_runtime::{ClaimLimit, Idem, IdemError, InFlight};

suite!(
    a_flood_of_new_keys_is_held_to_the_allowance,
    a_duplicate_of_a_call_in_flight_is_not_refused
);

const HOUR: Duration = Duration::from_secs(3600);

async fn pay(idem: &Idem, who: &str, key: &str, runs: &Counter) -> Result<u64, IdemError> {
    let runs = runs.clone();
    idem.operation("pay", key)
        .scope(who)
        .retain(HOUR)
        .fingerprint_none()
        .run(|| async move { Ok::<_, IdemError>(runs.hit() as u64) })
        .await
}

async fn a_flood_of_new_keys_is_held_to_the_allowance(ctx: Ctx) {
    const BURST: usize = 5;
    let idem = ctx
        .variant(|b| b.limit_new_claims(ClaimLimit::new(BURST as u32, HOUR)))
        .await;
    let runs = Counter::default();
    // One of the flooder's allowance spent on a payment it will replay.
    let paid = pay(&idem, "flooder", "paid", &runs).await.unwrap();
    // Replays take nothing from it.
    for _ in 0..BURST {
        assert_eq!(pay(&idem, "flooder", "paid", &runs).await.unwrap(), paid);
    }
    // Ten times the allowance of new keys, at once.
    let flood = (0..BURST * 10).map(|n| {
        let (idem, runs) = (idem.clone(), runs.clone());
        tokio::spawn(async move { (n, pay(&idem, "flooder", &format!("f-{n}"), &runs).await) })
    });
    let answers = futures_util::future::join_all(flood).await;
    let (mut ran, mut refused) = (Vec::new(), Vec::new());
    for answer in answers {
        match answer.unwrap() {
            (n, Ok(_)) => ran.push(n),
            (n, Err(IdemError::RateLimited { retry_after, .. })) => {
                assert!(
                    retry_after > Duration::ZERO && retry_after <= HOUR,
                    "{retry_after:?}"
                );
                refused.push(n);
            }
            (n, Err(e)) => panic!("f-{n}: {e}"),
        }
    }
    assert_eq!(ran.len(), BURST - 1, "ran {ran:?}");
    assert_eq!(runs.get(), BURST, "one body run per allowed claim");
    // The flooder's replay still answers, and runs nothing.
    assert_eq!(pay(&idem, "flooder", "paid", &runs).await.unwrap(), paid);
    // A refused key is refused again, not half-recorded; an allowed one replays.
    let again = pay(&idem, "flooder", &format!("f-{}", refused[0]), &runs).await;
    assert!(
        matches!(again, Err(IdemError::RateLimited { .. })),
        "{again:?}"
    );
    let replay = pay(&idem, "flooder", &format!("f-{}", ran[0]), &runs).await;
    assert!(replay.is_ok(), "{replay:?}");
    assert_eq!(runs.get(), BURST);
    // Another principal has an allowance of its own.
    for n in 0..BURST {
        pay(&idem, "bystander", &format!("b-{n}"), &runs)
            .await
            .unwrap();
    }
    assert_eq!(runs.get(), BURST * 2);
    // The refused calls left no record.
    for n in refused {
        let id = idem
            .operation("pay", &format!("f-{n}"))
            .scope("flooder")
            .id()
            .clone();
        assert_eq!(idem.get(&id).await.unwrap(), None, "f-{n} left a record");
    }
}

async fn a_duplicate_of_a_call_in_flight_is_not_refused(ctx: Ctx) {
    let idem = ctx
        .variant(|b| b.limit_new_claims(ClaimLimit::new(2, HOUR)))
        .await;
    let runs = Counter::default();
    // The first of two claims: a call that holds its claim until told.
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (go, go_rx) = tokio::sync::oneshot::channel::<()>();
    let held = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("pay", "slow")
                .scope("alice")
                .retain(HOUR)
                .fingerprint_none()
                .run(|| async move {
                    let _ = started_tx.send(());
                    let _ = go_rx.await;
                    Ok::<_, IdemError>(7)
                })
                .await
        })
    };
    started.await.unwrap();
    pay(&idem, "alice", "second", &runs).await.unwrap();
    // Over the limit now: a new key is refused, a duplicate of the held call is not.
    let new = pay(&idem, "alice", "third", &runs).await;
    assert!(matches!(new, Err(IdemError::RateLimited { .. })), "{new:?}");
    let duplicate = idem
        .operation("pay", "slow")
        .scope("alice")
        .retain(HOUR)
        .fingerprint_none()
        .in_flight(InFlight::Reject)
        .run(|| async { Ok::<_, IdemError>(0) })
        .await;
    assert!(
        matches!(duplicate, Err(IdemError::InFlight { .. })),
        "{duplicate:?}"
    );
    go.send(()).unwrap();
    assert_eq!(held.await.unwrap().unwrap(), 7);
    // Its outcome replays to the duplicate, over the limit as it still is.
    let replay = idem
        .operation("pay", "slow")
        .scope("alice")
        .retain(HOUR)
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(0) })
        .await;
    assert_eq!(replay.unwrap(), 7);
    assert_eq!(runs.get(), 1);
}

/// Two instances on one store with a shared limit draw from one allowance; with counts
/// per process, each would allow its own.
async fn one_allowance_across_instances(ctx: Ctx) {
    let limit = || ClaimLimit::new(3, HOUR).shared();
    let a = ctx.variant(|b| b.limit_new_claims(limit())).await;
    let b = ctx.variant(|b| b.limit_new_claims(limit())).await;
    let runs = Counter::default();
    let mut allowed = 0;
    for n in 0..4 {
        for (idem, side) in [(&a, "a"), (&b, "b")] {
            match pay(idem, "tenant", &format!("{side}-{n}"), &runs).await {
                Ok(_) => allowed += 1,
                Err(IdemError::RateLimited { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert_eq!(allowed, 3);
    assert_eq!(runs.get(), 3);
    // Another key of the limit is untouched.
    pay(&a, "other tenant", "o-1", &runs).await.unwrap();
}

#[tokio::test]
async fn a_shared_count_is_one_allowance_on_postgres() {
    if let Some(ctx) = Ctx::open(Backend::Postgres, "shared_claim_count_pg").await {
        let cleanup = ctx.cleanup();
        one_allowance_across_instances(ctx).await;
        cleanup.run().await;
    }
}

#[tokio::test]
async fn a_shared_count_is_one_allowance_on_redis() {
    if let Some(ctx) = Ctx::open(Backend::Redis, "shared_claim_count_redis").await {
        let cleanup = ctx.cleanup();
        one_allowance_across_instances(ctx).await;
        cleanup.run().await;
    }
}

#[tokio::test]
async fn a_shared_count_on_a_store_that_cannot_hold_it_is_refused_at_open() {
    let err = Idem::builder()
        .limit_new_claims(ClaimLimit::new(3, HOUR).shared())
        .sqlite("sqlite::memory:")
        .await
        .unwrap_err();
    assert!(matches!(err, IdemError::Config { .. }), "{err}");
    assert!(err.to_string().contains("PostgreSQL or Redis"), "{err}");
}

#[tokio::test]
async fn a_transactional_claim_over_the_limit_is_undone() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("tx.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let idem = Idem::builder()
        .limit_new_claims(ClaimLimit::new(1, HOUR))
        .pool(pool.clone())
        .await
        .unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    for (key, allowed) in [("t-1", true), ("t-2", false)] {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        let op = idem
            .operation("ledger", key)
            .retain(HOUR)
            .fingerprint_none();
        match op.begin_tx::<_, u32, IdemError>(&mut tx).await {
            Ok(idem_runtime::TxStep::Run(guard)) => {
                assert!(allowed, "{key} ran");
                sqlx::query("INSERT INTO ledger VALUES (?)")
                    .bind(key)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                guard
                    .finish(&mut tx, Ok::<u32, IdemError>(1))
                    .await
                    .unwrap();
            }
            Err(IdemError::RateLimited { .. }) => assert!(!allowed, "{key} refused"),
            Ok(idem_runtime::TxStep::Replay(_)) => panic!("{key} replayed"),
            Err(e) => panic!("{key}: {e}"),
        }
        // The application's transaction commits either way.
        tx.commit().await.unwrap();
    }
    let id = idem.operation("ledger", "t-2").id().clone();
    assert_eq!(
        idem.get(&id).await.unwrap(),
        None,
        "the refused claim left a record"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}
