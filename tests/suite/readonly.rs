//! A read-only server (a failover in progress: a demoted primary, a replica) refuses
//! idem's writes. Each store reports that as a retryable store error that is not
//! "unreachable": the body does not run, and `fail_open` does not run it unprotected
//! either, since the server answered and still holds the records.
//!
//! Each test runs a server of its own (see `common/own_servers.rs`) and makes it
//! read-only the way a failover does, never the shared servers.
use crate::own_servers;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::{Idem, IdemError, OnStoreError};
#[allow(unused_imports)]
use own_servers::*;

/// A call under `policy` that records `1`, counting its runs in `runs`.
async fn call(
    idem: &Idem,
    key: &str,
    policy: OnStoreError,
    runs: &AtomicUsize,
) -> Result<u32, IdemError> {
    idem.operation("charge", key)
        .on_store_error(policy)
        .retain(Duration::from_secs(3600))
        .fingerprint_none()
        .run(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, IdemError>(1)
        })
        .await
}

/// Calls on a fresh key, under `fail_closed` and under `fail_open`, are refused with a
/// retryable store error whose message contains `says`, and neither body runs.
async fn assert_refused_as_read_only(idem: &Idem, says: &str) {
    for policy in [OnStoreError::FailClosed, OnStoreError::FailOpen] {
        let runs = AtomicUsize::new(0);
        let key = format!("while-read-only-{policy:?}");
        match call(idem, &key, policy, &runs).await {
            Err(e @ IdemError::Store { .. }) => {
                assert!(e.is_retryable(), "{policy:?}: not retryable: {e}");
                let text = e.to_string();
                assert!(text.contains(says), "{policy:?}: {text}");
            }
            other => panic!("{policy:?}: a read-only server answered {other:?}"),
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            0,
            "{policy:?}: the body ran on a read-only server"
        );
    }
}

/// Opening on a read-only server fails as a retryable store error naming the cause.
fn assert_open_refused(opened: Result<Idem, IdemError>, says: &str) {
    match opened {
        Err(e @ IdemError::Store { .. }) => {
            assert!(e.is_retryable(), "not retryable: {e}");
            assert!(e.to_string().contains(says), "{e}");
        }
        Err(other) => panic!("opening on a read-only server: {other:?}"),
        Ok(_) => panic!("opened on a read-only server"),
    }
}

/// Polls `check` every 50 ms until it holds, up to 30 seconds.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "{what} within 30s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// PostgreSQL with `default_transaction_read_only` set for the whole server (as a
/// switchover does before demoting a primary): SQLSTATE 25006, on idem's connections
/// that were open before, and on new ones.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_read_only_is_retryable_and_never_fails_open() {
    use sqlx::Connection;
    let Some(server) = OwnPostgres::start("postgres_read_only", &[]) else {
        return;
    };
    let url = server.url();
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .postgres(&url)
        .await
        .unwrap();
    let runs = AtomicUsize::new(0);
    call(&idem, "before", OnStoreError::FailClosed, &runs)
        .await
        .unwrap();
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("ALTER SYSTEM SET default_transaction_read_only = on")
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut admin)
        .await
        .unwrap();
    // A new session sees it once the server has reloaded, and by then the server has
    // told every open session to reload before its next statement.
    eventually("a new session is read-only", || async {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        let on: String = sqlx::query_scalar("SHOW default_transaction_read_only")
            .fetch_one(&mut c)
            .await
            .unwrap();
        on == "on"
    })
    .await;
    assert_refused_as_read_only(&idem, "read-only transaction").await;
    assert_open_refused(Idem::postgres(&url).await, "read-only transaction");
}

/// MariaDB with `read_only` (as a failover sets on the demoted primary): error 1290
/// for a user without `SUPER` / `READ_ONLY ADMIN`, on the pool's open connections.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_read_only_is_retryable_and_never_fails_open() {
    use sqlx::Connection;
    let Some(server) = OwnMariaDb::start("mariadb_read_only") else {
        return;
    };
    let mut root = sqlx::MySqlConnection::connect(&server.url("root", "mysql"))
        .await
        .unwrap();
    // `read_only` does not bind users with SUPER, so idem connects as one without it.
    let url = server.idem_user(&mut root).await;
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .mysql(&url)
        .await
        .unwrap();
    let runs = AtomicUsize::new(0);
    call(&idem, "before", OnStoreError::FailClosed, &runs)
        .await
        .unwrap();
    sqlx::raw_sql("SET GLOBAL read_only = 1")
        .execute(&mut root)
        .await
        .unwrap();
    assert_refused_as_read_only(&idem, "--read-only").await;
    assert_open_refused(Idem::mysql(&url).await, "--read-only");
}

/// Redis after a failover: the replica promoted (`REPLICAOF NO ONE`), the old primary
/// made its replica, idem still connected to the old one: `READONLY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_replica_is_retryable_and_never_fails_open() {
    let Some(primary) = OwnRedis::start("redis_read_only", &[]) else {
        return;
    };
    let primary_port = primary.port().to_string();
    let Some(replica) = OwnRedis::start(
        "redis_read_only",
        &["--replicaof", "127.0.0.1", &primary_port],
    ) else {
        return;
    };
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .redis(&primary.url())
        .await
        .unwrap();
    let runs = AtomicUsize::new(0);
    call(&idem, "before", OnStoreError::FailClosed, &runs)
        .await
        .unwrap();
    let connect = |url: String| async move {
        redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    };
    let mut old = connect(primary.url()).await;
    let mut new = connect(replica.url()).await;
    let linked = |mut c: redis::aio::MultiplexedConnection| async move {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut c)
            .await
            .unwrap();
        info.contains("master_link_status:up")
    };
    eventually("the replica is in sync", || linked(new.clone())).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut new)
        .await
        .unwrap();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(replica.port())
        .query_async(&mut old)
        .await
        .unwrap();
    eventually("the old primary follows the new one", || {
        linked(old.clone())
    })
    .await;
    assert_refused_as_read_only(&idem, "read only replica").await;
}
