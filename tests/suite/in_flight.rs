//! Duplicates that arrive while the first call runs.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{IdemError, InFlight};
use std::time::Duration;

suite!(
    reject_answers_at_once_with_retry_after,
    waiter_gets_the_outcome,
    waiter_mismatch_is_checked_first,
    waiters_are_capped
);

async fn reject_answers_at_once_with_retry_after(ctx: Ctx) {
    let (go, task) = hold(&ctx.idem, "m-1", 1).await;
    let r = ctx
        .idem
        .operation("send", "m-1")
        .fingerprint(&1)
        .in_flight(InFlight::Reject)
        .retain(std::time::Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(9) })
        .await;
    match r {
        Err(e @ IdemError::InFlight { .. }) => {
            assert!(e.is_retryable());
            let after = e.retry_after().unwrap();
            // The default lease, which a store with a millisecond clock holds up to 2 ms
            // longer.
            assert!(
                after > Duration::ZERO && after <= Duration::from_millis(60_002),
                "{after:?}"
            );
        }
        other => panic!("expected in-flight, got {other:?}"),
    }
    go.send(()).unwrap();
    assert_eq!(task.await.unwrap().unwrap(), 1);
}

async fn waiter_gets_the_outcome(ctx: Ctx) {
    let (go, task) = hold(&ctx.idem, "m-2", 2).await;
    let idem = ctx.idem.clone();
    let waiter = tokio::spawn(async move {
        idem.operation("send", "m-2")
            .fingerprint(&2)
            .in_flight(InFlight::Wait(Duration::from_secs(30)))
            .retain(std::time::Duration::from_secs(86_400))
            .run(|| async { Ok::<_, IdemError>(99) })
            .await
    });
    tokio::task::yield_now().await;
    go.send(()).unwrap();
    assert_eq!(task.await.unwrap().unwrap(), 2);
    assert_eq!(waiter.await.unwrap().unwrap(), 2);
}

async fn waiter_mismatch_is_checked_first(ctx: Ctx) {
    let (go, task) = hold(&ctx.idem, "m-3", 3).await;
    let r = ctx
        .idem
        .operation("send", "m-3")
        .fingerprint(&4)
        .in_flight(InFlight::Wait(Duration::from_secs(30)))
        .retain(std::time::Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(4) })
        .await;
    assert!(matches!(r, Err(IdemError::Mismatch { .. })), "{r:?}");
    go.send(()).unwrap();
    task.await.unwrap().unwrap();
}

async fn waiters_are_capped(ctx: Ctx) {
    let idem = ctx.variant(|b| b.max_waiters(2)).await;
    let (go, task) = hold(&idem, "m-4", 4).await;
    let callers: Vec<_> = (0..10)
        .map(|_| {
            let idem = idem.clone();
            tokio::spawn(async move {
                idem.operation("send", "m-4")
                    .fingerprint(&4)
                    .in_flight(InFlight::Wait(Duration::from_secs(60)))
                    .retain(std::time::Duration::from_secs(86_400))
                    .run(|| async { Ok::<_, IdemError>(0) })
                    .await
            })
        })
        .collect();
    // Past the cap, callers are answered at once while the first call still runs.
    let mut tries = 0;
    while callers.iter().filter(|c| c.is_finished()).count() < 8 {
        tries += 1;
        assert!(tries < 3000, "callers past the cap were not answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    go.send(()).unwrap();
    assert_eq!(task.await.unwrap().unwrap(), 4);
    let (mut capped, mut served) = (0, 0);
    for c in callers {
        match c.await.unwrap() {
            Err(IdemError::TooManyWaiters { .. }) => capped += 1,
            Ok(4) => served += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((capped, served), (8, 2));
}
