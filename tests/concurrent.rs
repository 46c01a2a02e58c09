//! Real contention: many tasks released together on one key.
mod common;
use common::*;
use idem_runtime::{IdemError, InFlight};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

suite!(many_callers_one_key_run_once, many_keys_run_once_each);

const WAIT: InFlight = InFlight::Wait(Duration::from_secs(60));

async fn many_callers_one_key_run_once(ctx: Ctx) {
    const TASKS: usize = 64;
    const ROUNDS: usize = 20;
    for round in 0..ROUNDS {
        let runs = Counter::default();
        let barrier = Arc::new(Barrier::new(TASKS));
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let (idem, runs, barrier) = (ctx.idem.clone(), runs.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    idem.operation("charge", &round)
                        .in_flight(WAIT)
                        .fingerprint(&"same payload")
                        .run(move || async move {
                            let n = runs.hit();
                            tokio::task::yield_now().await;
                            Ok::<_, IdemError>(n)
                        })
                        .await
                })
            })
            .collect();
        for t in tasks {
            assert_eq!(
                t.await.unwrap().unwrap(),
                1,
                "every caller sees the one execution"
            );
        }
        assert_eq!(
            runs.get(),
            1,
            "round {round}: the body ran {} times",
            runs.get()
        );
    }
}

async fn many_keys_run_once_each(ctx: Ctx) {
    const KEYS: usize = 2_000;
    const CALLERS: usize = 4;
    let runs = Counter::default();
    let barrier = Arc::new(Barrier::new(KEYS * CALLERS));
    let tasks: Vec<_> = (0..KEYS * CALLERS)
        .map(|i| {
            let (idem, runs, barrier) = (ctx.idem.clone(), runs.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let key = i % KEYS;
                idem.operation("deliver", &key)
                    .in_flight(WAIT)
                    .run(move || async move {
                        runs.hit();
                        Ok::<_, IdemError>(key)
                    })
                    .await
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap().unwrap(), i % KEYS);
    }
    assert_eq!(runs.get(), KEYS);
    assert_eq!(ctx.idem.stats().await.unwrap().completed, KEYS as u64);
}
