//! First calls, mismatches and scopes.
mod common;
use common::*;
use idem_runtime::IdemError;

suite!(
    first_call_runs,
    mismatch_is_refused,
    scopes_separate_operations,
    keys_are_typed
);

async fn first_call_runs(ctx: Ctx) {
    let runs = Counter::default();
    let out = ctx
        .idem
        .operation("charge", "order-1")
        .fingerprint(&1999)
        .run(|| async {
            runs.hit();
            Ok::<_, IdemError>("receipt-1".to_string())
        })
        .await
        .unwrap();
    assert_eq!(out, "receipt-1");
    assert_eq!(runs.get(), 1);
}

async fn mismatch_is_refused(ctx: Ctx) {
    let runs = Counter::default();
    let call = |amount: u32| {
        let runs = runs.clone();
        ctx.idem
            .operation("charge", "order-2")
            .fingerprint(&amount)
            .run(move || async move {
                runs.hit();
                Ok::<_, IdemError>(amount)
            })
    };
    assert_eq!(call(10).await.unwrap(), 10);
    let err = call(20).await.unwrap_err();
    assert!(matches!(err, IdemError::Mismatch { .. }), "{err}");
    // The old outcome is not replayed for the new payload, nor the new one run.
    assert_eq!(runs.get(), 1);
    assert_eq!(call(10).await.unwrap(), 10);
    assert_eq!(runs.get(), 1);
}

async fn scopes_separate_operations(ctx: Ctx) {
    let runs = Counter::default();
    for tenant in ["acme", "globex", "acme", "globex"] {
        let got = ctx
            .idem
            .operation("charge", "order-3")
            .scope(tenant)
            .fingerprint(&tenant)
            .run(|| async {
                runs.hit();
                Ok::<_, IdemError>(tenant.to_string())
            })
            .await
            .unwrap();
        assert_eq!(got, tenant);
    }
    assert_eq!(runs.get(), 2);
}

async fn keys_are_typed(ctx: Ctx) {
    let runs = Counter::default();
    let r = runs.clone();
    let body = move || {
        let r = r.clone();
        async move {
            r.hit();
            Ok::<_, IdemError>(())
        }
    };
    ctx.idem
        .operation("op", &42)
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", "42")
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", &("a:b", "c"))
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", &("a", "b:c"))
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem.operation("op", &42u8).run(body).await.unwrap();
    assert_eq!(
        runs.get(),
        4,
        "42 and \"42\" differ, the tuples differ, 42u8 is 42"
    );
}

#[tokio::test]
async fn hashed_keys_never_reach_the_store() {
    let idem = idem_runtime::Idem::builder().hash_keys(true).memory();
    let runs = Counter::default();
    for _ in 0..2 {
        idem.operation("email", "alice@example.com")
            .run(|| async {
                runs.hit();
                Ok::<_, IdemError>(())
            })
            .await
            .unwrap();
    }
    assert_eq!(runs.get(), 1, "hashed keys still deduplicate");
    let listed = idem
        .list(&idem_runtime::ListFilter::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].id.key.starts_with("h:"), "{}", listed[0].id.key);
    assert!(!listed[0].id.key.contains("alice"));
}
