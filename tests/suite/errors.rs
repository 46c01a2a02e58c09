//! What an `Err` from the body does: release, record, classify.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{Disposition, IdemError, ListFilter, Resolution, State};
use std::time::Duration;

suite!(
    released_error_runs_again,
    recorded_error_replays,
    classified_unknown_blocks_until_resolved,
    resolve_completed_replays
);

async fn released_error_runs_again(ctx: Ctx) {
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        ctx.idem
            .operation("charge", "o-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                if runs.hit() == 1 {
                    Err(AppError::Timeout)
                } else {
                    Ok("paid".to_string())
                }
            })
    };
    assert_eq!(call().await, Err(AppError::Timeout));
    assert_eq!(call().await.unwrap(), "paid");
    assert_eq!(call().await.unwrap(), "paid");
    assert_eq!(runs.get(), 2);
}

async fn recorded_error_replays(ctx: Ctx) {
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        ctx.idem
            .operation("charge", "o-2")
            .record_errors()
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                runs.hit();
                Err::<String, _>(AppError::Declined("card expired".into()))
            })
    };
    let first = call().await;
    assert_eq!(first, Err(AppError::Declined("card expired".into())));
    assert_eq!(call().await, first);
    assert_eq!(runs.get(), 1);
}

fn classify(e: &AppError) -> Disposition {
    match e {
        AppError::Declined(_) => Disposition::Record,
        AppError::Timeout => Disposition::Unknown,
        AppError::Idem(_) => Disposition::Release,
    }
}

async fn classified_unknown_blocks_until_resolved(ctx: Ctx) {
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        ctx.idem
            .operation("charge", "o-3")
            .classify(classify)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                if runs.hit() == 1 {
                    Err(AppError::Timeout)
                } else {
                    Ok(5u32)
                }
            })
    };
    assert_eq!(call().await, Err(AppError::Timeout));
    // The effect may have happened: duplicates are told, the body does not run.
    let err = call().await.unwrap_err();
    assert!(err_is_unknown(&err), "{err:?}");
    assert_eq!(runs.get(), 1);

    let unknown = ctx.idem.list(&ListFilter::unknown()).await.unwrap();
    assert_eq!(unknown.len(), 1);
    assert_eq!(unknown[0].state, State::Unknown);
    let stats = ctx.idem.stats().await.unwrap();
    assert_eq!(stats.unknown, 1);
    assert!(stats.oldest_unknown.is_some());

    // A stale epoch cannot resolve it; the right one can.
    let id = unknown[0].id.clone();
    let stale = ctx
        .idem
        .resolve(&id, unknown[0].epoch + 1, Resolution::Retry)
        .await;
    assert!(matches!(stale, Err(IdemError::Fenced { .. })), "{stale:?}");
    ctx.idem
        .resolve(&id, unknown[0].epoch, Resolution::Retry)
        .await
        .unwrap();
    assert_eq!(call().await.unwrap(), 5);
    assert_eq!(runs.get(), 2);
}

fn err_is_unknown(e: &AppError) -> bool {
    matches!(e, AppError::Idem(m) if m.contains("UNKNOWN"))
}

async fn resolve_completed_replays(ctx: Ctx) {
    let runs = Counter::default();
    let call = || {
        let runs = runs.clone();
        ctx.idem
            .operation("email", "e-1")
            .classify(classify)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(move || async move {
                runs.hit();
                Err::<u32, _>(AppError::Timeout)
            })
    };
    assert_eq!(call().await, Err(AppError::Timeout));
    let id = ctx.idem.operation("email", "e-1").id().clone();
    let rec = ctx.idem.list(&ListFilter::unknown()).await.unwrap();
    assert_eq!(rec[0].id, id);
    ctx.idem
        .resolve(
            &id,
            rec[0].epoch,
            Resolution::Completed {
                outcome: serde_json::json!(77),
                version: 1,
                retain: Duration::from_secs(60),
            },
        )
        .await
        .unwrap();
    assert_eq!(call().await.unwrap(), 77);
    assert_eq!(runs.get(), 1);
}
