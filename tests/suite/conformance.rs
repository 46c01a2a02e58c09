//! The store conformance suite, on every store this workspace ships. Transactional
//! mode's (`conformance::tx`) runs in tests/suite/transactional.rs, which opens each SQL
//! database for it.
use crate::common;
use idem_runtime::store::{MemoryStore, conformance};

#[tokio::test]
async fn memory_store_conforms() {
    conformance::run_all(&MemoryStore::default()).await;
}

/// The other stores are reached through an `Idem`'s layer hook, which hands over the
/// opened store: the suite then runs on exactly what `Idem::sqlite`, `Idem::postgres`
/// and the rest use.
async fn conform(open: impl AsyncFnOnce(idem_runtime::IdemBuilder) -> idem_runtime::Idem) {
    let (idem, store) = common::open_with_store(idem_runtime::Idem::builder(), open).await;
    conformance::run_all(&*store).await;
    drop(idem);
}

// The SQL stores' tests run on two worker threads, so the steps the suite records at once
// reach the database in parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_file_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("conformance.db").display());
    conform(async |b| b.sqlite(&url).await.unwrap()).await;
}

/// `sqlite::memory:`: the database lives in the store's one connection, where a file
/// is reached through a pool of several.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_in_memory_store_conforms() {
    conform(async |b| b.sqlite("sqlite::memory:").await.unwrap()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_store_conforms() {
    if common::mysql_skip("mysql_store_conforms").is_some() {
        return;
    }
    let table = common::unique_table("conformance");
    conform(async |b| b.table(&table).mysql(&common::mysql_url()).await.unwrap()).await;
    common::Cleanup::for_mysql_table(&table).run().await;
}
