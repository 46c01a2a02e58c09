//! The store conformance suite, on every store this workspace ships. Transactional
//! mode's (`conformance::tx`) runs in tests/transactional.rs, which opens each SQL
//! database for it.
use crate::common;
use idem_runtime::store::{MemoryStore, conformance};

#[tokio::test]
async fn memory_store_conforms() {
    conformance::run_all(&MemoryStore::default()).await;
}

/// The SQL stores are reached through an `Idem`'s layer hook, which hands over the
/// opened store: the suite then runs on exactly what `Idem::sqlite` and
/// `Idem::postgres` use.
async fn conform(open: impl AsyncFnOnce(idem_runtime::IdemBuilder) -> idem_runtime::Idem) {
    let slot = std::sync::Arc::new(std::sync::Mutex::new(None));
    let s = slot.clone();
    let idem = open(idem_runtime::Idem::builder().layer(move |store| {
        *s.lock().unwrap() = Some(store.clone());
        store
    }))
    .await;
    let store = slot
        .lock()
        .unwrap()
        .take()
        .expect("the layer saw the store");
    conformance::run_all(&*store).await;
    drop(idem);
}

#[tokio::test]
async fn sqlite_file_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("conformance.db").display());
    conform(async |b| b.sqlite(&url).await.unwrap()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_store_conforms() {
    if common::postgres_skip("postgres_store_conforms").is_some() {
        return;
    }
    let table = common::unique_table("conformance");
    conform(async |b| {
        b.table(&table)
            .postgres(&common::postgres_url())
            .await
            .unwrap()
    })
    .await;
    let ctx_cleanup = common::Cleanup::for_table(&table);
    ctx_cleanup.run().await;
}

#[tokio::test]
async fn redis_store_conforms() {
    if common::redis_skip("redis_store_conforms").is_some() {
        return;
    }
    let prefix = common::unique_prefix("conformance");
    conform(async |b| {
        b.key_prefix(&prefix)
            .redis(&common::redis_url())
            .await
            .unwrap()
    })
    .await;
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_store_conforms() {
    if common::mysql_skip("mysql_store_conforms").is_some() {
        return;
    }
    let table = common::unique_table("conformance");
    conform(async |b| b.table(&table).mysql(&common::mysql_url()).await.unwrap()).await;
    common::Cleanup::for_mysql_table(&table).run().await;
}
