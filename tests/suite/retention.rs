//! Retention, purge and operations queries.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{IdemError, InFlight, ListFilter};
use std::time::Duration;

suite!(
    expired_record_is_absent,
    purge_removes_only_expired_completed
);

/// A record replays within its retention; past it the key is free again, for any
/// payload.
async fn expired_record_is_absent(ctx: Ctx) {
    let runs = Counter::default();
    let call = |key: &'static str, retain: Duration, amount: u32| {
        let runs = runs.clone();
        ctx.idem
            .operation("charge", key)
            .retain(retain)
            .fingerprint(&amount)
            .run(move || async move {
                runs.hit();
                Ok::<_, IdemError>(amount)
            })
    };
    // Replayed: kept a minute, so no delay between the calls can expire it first.
    let kept = Duration::from_secs(60);
    assert_eq!(call("o-kept", kept, 1).await.unwrap(), 1);
    assert_eq!(call("o-kept", kept, 1).await.unwrap(), 1);
    assert_eq!(runs.get(), 1);
    // Past retention the key is free again, for any payload (a later call, all the more).
    let brief = Duration::from_millis(200);
    assert_eq!(call("o-exp", brief, 1).await.unwrap(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(call("o-exp", brief, 2).await.unwrap(), 2);
    assert_eq!(runs.get(), 3);
}

async fn purge_removes_only_expired_completed(ctx: Ctx) {
    let idem = ctx.variant(|b| b.renew_leases(false)).await;
    // One completed and expiring, one completed and kept, one UNKNOWN, one in progress.
    idem.operation("a", "expiring")
        .retain(Duration::from_millis(100))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await
        .unwrap();
    idem.operation("a", "kept")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await
        .unwrap();
    let _ = idem
        .operation("a", "unknown")
        .classify(|_: &AppError| idem_runtime::Disposition::Unknown)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Err::<(), _>(AppError::Timeout) })
        .await;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let holder = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("a", "running")
                .lease(Duration::from_millis(50))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    let _ = tx.send(());
                    std::future::pending::<()>().await;
                    Ok::<_, IdemError>(())
                })
                .await
        })
    };
    rx.await.unwrap();
    holder.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(idem.purge_expired().await.unwrap(), 1);
    assert_eq!(idem.purge_expired().await.unwrap(), 0);
    let stats = idem.stats().await.unwrap();
    assert_eq!(
        (stats.completed, stats.unknown, stats.in_progress),
        (1, 1, 1)
    );
    assert_eq!(
        idem.list(&ListFilter::stuck(Duration::from_millis(100)))
            .await
            .unwrap()
            .len(),
        1
    );
    // The in-progress record, lease lapsed, is still there to be taken over, not purged.
    let r = idem
        .operation("a", "running")
        .in_flight(InFlight::Reject)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await;
    assert!(r.is_ok(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaper_purges_in_the_background_until_dropped() {
    let idem = idem_runtime::Idem::memory();
    idem.operation("a", "short")
        .retain(Duration::from_millis(20))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await
        .unwrap();
    let reaper = idem.spawn_reaper(Duration::from_millis(10));
    let mut tries = 0;
    while idem.stats().await.unwrap().completed > 0 {
        tries += 1;
        assert!(tries < 1000, "the reaper never purged");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(reaper);
    // Stopped: a newly expired record stays until purged by hand.
    idem.operation("a", "short2")
        .retain(Duration::from_millis(20))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(idem.stats().await.unwrap().completed, 1);
    assert_eq!(idem.purge_expired().await.unwrap(), 1);
}
