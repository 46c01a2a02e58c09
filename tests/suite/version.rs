//! Outcome schema versions and upgrades.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::IdemError;

suite!(
    changed_version_is_a_clear_error,
    upgrade_converts_old_outcomes
);

async fn record_v1(ctx: &Ctx) {
    ctx.idem
        .operation("quote", "q-1")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(serde_json::json!({"cents": 500})) })
        .await
        .unwrap();
}

async fn changed_version_is_a_clear_error(ctx: Ctx) {
    record_v1(&ctx).await;
    let runs = Counter::default();
    let r = ctx
        .idem
        .operation("quote", "q-1")
        .version(2)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            runs.hit();
            Ok::<_, IdemError>(0u64)
        })
        .await;
    match r {
        Err(IdemError::Codec { name, message }) => {
            assert_eq!(name, "quote");
            assert!(
                message.contains("version 1") && message.contains("version 2"),
                "{message}"
            );
        }
        other => panic!("expected a codec error, got {other:?}"),
    }
    assert_eq!(runs.get(), 0, "never a silent re-run");
}

fn upgrade(from: u32, old: serde_json::Value) -> Result<u64, IdemError> {
    assert_eq!(from, 1);
    Ok(old["cents"].as_u64().unwrap_or(0) * 10)
}

async fn upgrade_converts_old_outcomes(ctx: Ctx) {
    record_v1(&ctx).await;
    let got = ctx
        .idem
        .operation("quote", "q-1")
        .version(2)
        .upgrade(upgrade)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(0u64) })
        .await
        .unwrap();
    assert_eq!(got, 5000);
}
