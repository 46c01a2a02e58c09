//! Completed duplicates replay the recorded outcome.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{IdemError, observe};
use serde::{Deserialize, Serialize};

suite!(
    completed_duplicate_replays,
    replay_survives_a_new_handle,
    observe_tells_replays_apart,
    a_replayed_recorded_error_is_a_replay
);

async fn a_replayed_recorded_error_is_a_replay(ctx: Ctx) {
    let call = || {
        ctx.idem
            .operation("charge", "declined-1")
            .record_errors()
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Err::<u32, AppError>(AppError::Declined("card".into())) })
    };
    let (first, info) = observe(call()).await;
    assert_eq!(first, Err(AppError::Declined("card".into())));
    assert!(!info.replayed());
    let (again, info) = observe(call()).await;
    assert_eq!(again, Err(AppError::Declined("card".into())));
    assert!(info.replayed(), "a recorded error replayed must say so");
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    cents: u64,
    lines: Vec<(String, u32)>,
}

async fn completed_duplicate_replays(ctx: Ctx) {
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        ctx.idem
            .operation("charge", "order-9")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                let n = runs.hit();
                Ok::<_, IdemError>(Receipt {
                    id: format!("rcpt-{n}"),
                    cents: 1999,
                    lines: vec![("widget".into(), 2)],
                })
            })
    };
    let first = call().await.unwrap();
    for _ in 0..5 {
        assert_eq!(call().await.unwrap(), first);
    }
    assert_eq!(runs.get(), 1);
}

async fn replay_survives_a_new_handle(ctx: Ctx) {
    if ctx.backend == Backend::Memory {
        return; // a new memory handle is a new store, by design
    }
    let first = ctx
        .idem
        .operation("email", "welcome-7")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(7u32) })
        .await
        .unwrap();
    let again = ctx.handle(|b| b).await.unwrap();
    let replayed = again
        .operation("email", "welcome-7")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(8u32) })
        .await
        .unwrap();
    assert_eq!(replayed, first);
}

async fn observe_tells_replays_apart(ctx: Ctx) {
    // The epoch the body ran under, as the body saw it (0 until it runs).
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let call = || {
        let ran = ran.clone();
        ctx.idem
            .operation("webhook", "evt-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                let epoch = idem_runtime::current().epoch();
                ran.store(epoch, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, IdemError>(1)
            })
    };
    let (out, info) = observe(call()).await;
    assert_eq!(out.unwrap(), 1);
    assert!(!info.replayed());
    let epoch = ran.load(std::sync::atomic::Ordering::SeqCst);
    assert!(epoch > 0, "the body ran under a claim");
    assert_eq!(info.epoch(), Some(epoch), "the epoch that ran the body");
    let (out, info) = observe(call()).await;
    assert_eq!(out.unwrap(), 1);
    assert!(info.replayed());
    assert_eq!(info.epoch(), None, "a replay ran no body");
}
