//! What only the SQLite store does: group commit, where concurrent claims and records
//! share one transaction and one write's failure stays its own.
use crate::common;

use common::Counter;
use idem_runtime::{Idem, IdemError};

/// Callers per round: enough that writes wait on each other and share transactions.
const CALLERS: usize = 32;
const ROUNDS: usize = 8;

/// A key the database itself refuses (a trigger aborts its insert), written among
/// concurrent neighbours round after round: the refused call fails alone and runs no
/// body; every neighbour's body runs exactly once and its outcome is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_fails_alone_in_a_shared_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .sqlite(&url)
        .await
        .unwrap();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query(
        "CREATE TRIGGER poison BEFORE INSERT ON idem_operations \
         WHEN NEW.key LIKE '%poison%' BEGIN SELECT RAISE(ABORT, 'poisoned key'); END",
    )
    .execute(&pool)
    .await
    .unwrap();

    let runs = Counter::default();
    let poisoned_runs = Counter::default();
    for round in 0..ROUNDS {
        let mut calls = Vec::new();
        for i in 0..CALLERS {
            let idem = idem.clone();
            let (runs, poisoned_runs) = (runs.clone(), poisoned_runs.clone());
            let key = if i == CALLERS / 2 {
                format!("poison-{round}")
            } else {
                format!("k-{round}-{i}")
            };
            calls.push(tokio::spawn(async move {
                let poisoned = key.starts_with("poison");
                let r = idem
                    .operation("ship", &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(|| async {
                        if poisoned {
                            poisoned_runs.hit();
                        } else {
                            runs.hit();
                        }
                        Ok::<_, IdemError>(i)
                    })
                    .await;
                (poisoned, r)
            }));
        }
        for c in calls {
            match c.await.unwrap() {
                (true, Err(IdemError::Store { .. })) => {}
                (true, other) => panic!("the refused key answered {other:?}"),
                (false, r) => {
                    r.expect("a neighbour of the refused write failed");
                }
            }
        }
    }
    assert_eq!(poisoned_runs.get(), 0, "a refused claim ran its body");
    assert_eq!(runs.get(), ROUNDS * (CALLERS - 1));

    // Every neighbour's outcome is recorded: a retry replays without running.
    let replayed = Counter::default();
    for round in 0..ROUNDS {
        for i in (0..CALLERS).filter(|&i| i != CALLERS / 2) {
            let got = idem
                .operation("ship", &format!("k-{round}-{i}"))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async {
                    replayed.hit();
                    Ok::<_, IdemError>(usize::MAX)
                })
                .await
                .unwrap();
            assert_eq!(got, i);
        }
    }
    assert_eq!(replayed.get(), 0, "a recorded outcome was lost");
}

/// Callers that go away while their claims wait on the database lock (one writing, one
/// queued behind it for group commit) leave no claim behind: once the lock is free,
/// the claims that still land are released, and the key's next caller runs the body
/// rather than waiting out a lease nobody holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_cancelled_while_queued_are_not_left_behind() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let idem = Idem::sqlite(&url).await.unwrap();
    // Another process holds the write lock.
    let holder = sqlx::SqlitePool::connect(&url).await.unwrap();
    let lock = holder.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let call = |idem: Idem, n: u32| async move {
        idem.operation("ship", "order-1")
            .retain(Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async move { Ok::<_, IdemError>(n) })
            .await
    };
    let waiting: Vec<_> = (0..2)
        .map(|n| tokio::spawn(call(idem.clone(), n)))
        .collect();
    // Long enough for both claims to be sent: one on the lock, one queued behind it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for w in &waiting {
        w.abort();
    }
    for w in waiting {
        assert!(w.await.unwrap_err().is_cancelled());
    }
    lock.rollback().await.unwrap();
    // The abandoned claims' lease is the default minute: a caller waiting 10 s runs the
    // body only if they were released.
    let next = idem
        .operation("ship", "order-1")
        .retain(Duration::from_secs(86_400))
        .fingerprint_none()
        .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(10)))
        .run(|| async { Ok::<_, IdemError>(7) })
        .await;
    assert_eq!(next.unwrap(), 7, "an abandoned claim held the key");
}
