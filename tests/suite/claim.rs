//! First calls, mismatches and scopes.
use crate::common;
use crate::suite;
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
        .retain(std::time::Duration::from_secs(86_400))
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
            .retain(std::time::Duration::from_secs(86_400))
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
            .retain(std::time::Duration::from_secs(86_400))
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
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", "42")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", &("a:b", "c"))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", &("a", "b:c"))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(body.clone())
        .await
        .unwrap();
    ctx.idem
        .operation("op", &42u8)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(body)
        .await
        .unwrap();
    assert_eq!(
        runs.get(),
        4,
        "42 and \"42\" differ, the tuples differ, 42u8 is 42"
    );
}

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

#[tokio::test]
async fn hashed_keys_never_reach_the_store() {
    let idem = idem_runtime::Idem::builder().hash_keys(SECRET).memory();
    let runs = Counter::default();
    for _ in 0..2 {
        idem.operation("email", "alice@example.com")
            .scope("tenant\0with-nul@example.com")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
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
    let scope = &listed[0].id.scope;
    assert!(
        scope.starts_with("h:") && !scope.contains("tenant"),
        "{scope}"
    );
    // Keyed: another secret gives another digest, so a dictionary of keys is no help.
    let other = idem_runtime::Idem::builder()
        .hash_keys(b"another secret of 32 bytes......")
        .memory();
    let id = other.operation("email", "alice@example.com").id().clone();
    assert_ne!(id.key, listed[0].id.key);
}

/// The key mode is recorded with the table: opening it in the other mode, or with
/// another secret, is a clear error rather than a silent change of every identity.
#[tokio::test]
async fn a_table_keeps_its_key_mode() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("modes.db").display());
    let hashed = idem_runtime::Idem::builder()
        .hash_keys(SECRET)
        .sqlite(&url)
        .await
        .unwrap();
    hashed
        .operation("email", "bob@example.com")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(1) })
        .await
        .unwrap();
    drop(hashed);
    let plain = idem_runtime::Idem::sqlite(&url).await;
    assert!(
        matches!(&plain, Err(IdemError::Config { message }) if message.contains("hash_keys")),
        "{plain:?}"
    );
    let other = idem_runtime::Idem::builder()
        .hash_keys(b"another secret of 32 bytes......")
        .sqlite(&url)
        .await;
    assert!(matches!(other, Err(IdemError::Config { .. })), "{other:?}");
    let again = idem_runtime::Idem::builder()
        .hash_keys(SECRET)
        .sqlite(&url)
        .await
        .unwrap();
    let replayed = again
        .operation("email", "bob@example.com")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(2) })
        .await
        .unwrap();
    assert_eq!(replayed, 1, "the same secret finds the same operation");

    let short = idem_runtime::Idem::builder()
        .hash_keys(b"short")
        .sqlite("sqlite::memory:")
        .await;
    assert!(matches!(short, Err(IdemError::Config { .. })), "{short:?}");
}
