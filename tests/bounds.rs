//! Caps on keys, scopes and outcomes are errors, never truncations.
mod common;
use common::*;
use idem_runtime::{IdemError, ListFilter};

suite!(
    oversized_key_is_refused,
    oversized_scope_is_refused,
    oversized_outcome_is_refused_and_not_rerun
);

async fn oversized_key_is_refused(ctx: Ctx) {
    let runs = Counter::default();
    let key = "k".repeat(300);
    let r = ctx
        .idem
        .operation("op", &key)
        .run(|| async {
            runs.hit();
            Ok::<_, IdemError>(())
        })
        .await;
    assert!(
        matches!(r, Err(IdemError::KeyTooLong { len, max: 255, .. }) if len > 300),
        "{r:?}"
    );
    assert_eq!(runs.get(), 0);
    // Just under the cap is fine ("s250:" + 250 bytes = 255).
    ctx.idem
        .operation("op", &"k".repeat(250))
        .run(|| async { Ok::<_, IdemError>(()) })
        .await
        .unwrap();
}

async fn oversized_scope_is_refused(ctx: Ctx) {
    let r = ctx
        .idem
        .operation("op", "k")
        .scope(&"t".repeat(256))
        .run(|| async { Ok::<_, IdemError>(()) })
        .await;
    assert!(matches!(r, Err(IdemError::ScopeTooLong { .. })), "{r:?}");
}

async fn oversized_outcome_is_refused_and_not_rerun(ctx: Ctx) {
    let idem = ctx.variant(|b| b.max_outcome_bytes(1024)).await;
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        idem.operation("export", "big").run(move || async move {
            runs.hit();
            Ok::<_, IdemError>("x".repeat(4096))
        })
    };
    let r = call().await;
    assert!(
        matches!(r, Err(IdemError::OutcomeTooLarge { max: 1024, .. })),
        "{r:?}"
    );
    // The body ran: it is parked in UNKNOWN, not released for a second run.
    let r = call().await;
    assert!(matches!(r, Err(IdemError::Unknown { .. })), "{r:?}");
    assert_eq!(runs.get(), 1);
    assert_eq!(idem.list(&ListFilter::unknown()).await.unwrap().len(), 1);
}
