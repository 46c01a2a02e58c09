//! idem's own PostgreSQL connections survive the server dropping them.
#![cfg(feature = "postgres")]
use crate::common;
use common::*;
use idem_runtime::{Idem, IdemError};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_succeed_after_the_server_drops_idle_connections() {
    if postgres_skip("reconnect").is_some() {
        return;
    }
    let app = format!("idem_reconnect_{}", std::process::id());
    let table = unique_table("reconnect");
    let url = postgres_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let idem = Idem::builder()
        .table(table.clone())
        .replay_cache_bytes(0)
        .postgres(&format!("{url}{sep}application_name={app}"))
        .await
        .unwrap();
    let call = |key: &'static str| {
        idem.operation("ship", key)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(key.len()) })
    };
    assert_eq!(call("first").await.unwrap(), 5);

    // A restart or an idle-connection reaper, as the server does it.
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&app)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert!(!killed.is_empty() && killed.iter().all(|k| *k));
    // Long enough idle that a connection is checked before it is used again.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    assert_eq!(
        call("second").await.unwrap(),
        6,
        "a fresh call after the drop"
    );
    assert_eq!(call("first").await.unwrap(), 5, "a replay after the drop");
    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
        .execute(&admin)
        .await;
    let _ = sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = $1")
        .bind(&table)
        .execute(&admin)
        .await;
}
