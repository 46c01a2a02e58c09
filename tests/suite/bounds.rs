//! Caps on keys, scopes and outcomes are errors, never truncations.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{IdemError, ListFilter, idempotent};

suite!(
    oversized_key_is_refused,
    empty_key_is_refused,
    oversized_scope_is_refused,
    oversized_outcome_is_refused_and_not_rerun,
    absurd_durations_are_refused_before_anything_is_written,
    an_operators_outcome_is_capped_too
);

async fn absurd_durations_are_refused_before_anything_is_written(ctx: Ctx) {
    use std::time::Duration;
    let runs = Counter::default();
    for (what, op) in [
        (
            "lease",
            ctx.idem
                .operation("op", "forever")
                .lease(Duration::MAX)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none(),
        ),
        (
            "wait",
            ctx.idem
                .operation("op", "forever")
                .in_flight(idem_runtime::InFlight::Wait(Duration::MAX))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none(),
        ),
    ] {
        let r = op
            .run(|| async {
                runs.hit();
                Ok::<_, IdemError>(())
            })
            .await;
        assert!(
            matches!(&r, Err(IdemError::Config { message }) if message.contains("366 days")),
            "{what}: {r:?}"
        );
    }
    assert_eq!(runs.get(), 0);
    let stats = ctx.idem.stats().await.unwrap();
    assert_eq!(
        stats.in_progress + stats.completed + stats.unknown,
        0,
        "nothing written"
    );
}

async fn an_operators_outcome_is_capped_too(ctx: Ctx) {
    let idem = ctx.variant(|b| b.max_outcome_bytes(64)).await;
    let op = || {
        idem.operation("op", "parked")
            .classify(|_: &AppError| idem_runtime::Disposition::Unknown)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
    };
    let r = op()
        .run(|| async { Err::<u8, AppError>(AppError::Timeout) })
        .await;
    assert!(r.is_err());
    let parked = idem.list(&ListFilter::unknown()).await.unwrap();
    let big = idem_runtime::Resolution::Completed {
        outcome: serde_json::json!("x".repeat(100)),
        version: 1,
        retain: std::time::Duration::from_secs(60),
    };
    let r = idem.resolve(&parked[0].id, parked[0].epoch, big).await;
    assert!(
        matches!(r, Err(IdemError::OutcomeTooLarge { max: 64, .. })),
        "{r:?}"
    );
    // Still UNKNOWN: nothing was recorded.
    assert_eq!(idem.list(&ListFilter::unknown()).await.unwrap().len(), 1);
}

/// The attribute's form of an operation keyed on an order id that may arrive empty.
#[idempotent(store = idem, key = order_id, retain = "1d")]
async fn charge_order(
    idem: &idem_runtime::Idem,
    order_id: &str,
    cents: u64,
    #[idem(skip)] runs: &Counter,
) -> Result<u64, IdemError> {
    runs.hit();
    Ok(cents)
}

/// An empty key, or a composite with an empty text part, is refused before anything is
/// written: two customers whose order id went missing are not one operation.
async fn empty_key_is_refused(ctx: Ctx) {
    use std::time::Duration;
    let runs = Counter::default();
    for cents in [500, 500, 700] {
        let r = charge_order(&ctx.idem, "", cents, &runs).await;
        assert!(
            matches!(&r, Err(IdemError::EmptyKey { name }) if name == "charge_order"),
            "attribute, {cents}: {r:?}"
        );
    }
    let keys: [&dyn Fn(&idem_runtime::Idem) -> idem_runtime::NewOperation; 3] = [
        &|idem| idem.operation("op", ""),
        &|idem| idem.operation("op", &("acme", "")),
        &|idem| idem.operation("op", &(7u64, String::new())),
    ];
    for (i, op) in keys.iter().enumerate() {
        let r = op(&ctx.idem)
            .retain(Duration::from_secs(60))
            .fingerprint_none()
            .run(|| async {
                runs.hit();
                Ok::<_, IdemError>(())
            })
            .await;
        assert!(
            matches!(&r, Err(IdemError::EmptyKey { name }) if name == "op"),
            "builder, key {i}: {r:?}"
        );
        assert!(r.unwrap_err().to_string().contains("empty"));
    }
    assert_eq!(runs.get(), 0, "a body ran under an empty key");
    let written = ctx.idem.list(&ListFilter::default()).await.unwrap();
    assert!(written.is_empty(), "an empty key wrote {written:?}");
    // A non-empty key beside an integer part is a key.
    assert_eq!(
        charge_order(&ctx.idem, "o-1", 500, &runs).await.unwrap(),
        500
    );
    assert_eq!(runs.get(), 1);
}

async fn oversized_key_is_refused(ctx: Ctx) {
    let runs = Counter::default();
    let key = "k".repeat(300);
    let r = ctx
        .idem
        .operation("op", &key)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
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
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await
        .unwrap();
}

async fn oversized_scope_is_refused(ctx: Ctx) {
    let r = ctx
        .idem
        .operation("op", "k")
        .scope(&"t".repeat(256))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(()) })
        .await;
    assert!(matches!(r, Err(IdemError::ScopeTooLong { .. })), "{r:?}");
}

async fn oversized_outcome_is_refused_and_not_rerun(ctx: Ctx) {
    let idem = ctx.variant(|b| b.max_outcome_bytes(1024)).await;
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        idem.operation("export", "big")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
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
