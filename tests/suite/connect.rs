//! `Idem::connect` and `IdemBuilder::connect`: each store opened by URL, with the
//! builder's options, proven to be the store the scheme names by reading its records
//! there directly; and what a URL that opens nothing reports.
use crate::common;

use std::time::Duration;

use idem_runtime::{Idem, IdemError};

/// The secret the tests that check `hash_keys` pass through `connect`.
const SECRET: &str = "a secret of at least 32 random bytes!";

/// How many times the body of one call on `key` ran: 1 for a first call, 0 for a replay.
async fn runs_of(idem: &Idem, key: &str) -> usize {
    let runs = common::Counter::default();
    let got = common::counted_call(
        idem,
        "connect-charge",
        key,
        Duration::from_secs(600),
        &runs,
        7,
    )
    .await
    .unwrap();
    assert_eq!(got, 7);
    runs.get()
}

/// A call and its retry: the body runs once, the retry replays.
async fn call_and_replay(idem: &Idem, key: &str) {
    assert_eq!(runs_of(idem, key).await, 1, "the first call did not run");
    assert_eq!(runs_of(idem, key).await, 0, "the retry ran the body again");
}

#[tokio::test]
async fn memory_by_url() {
    let idem = Idem::connect("memory:").await.unwrap();
    call_and_replay(&idem, "m-1").await;
    // Another `memory:` store is another process's: it has none of the first's records.
    let other = Idem::connect("memory:").await.unwrap();
    assert_eq!(runs_of(&other, "m-1").await, 1);
}

/// A SQLite file by `sqlite://PATH`, with the builder's table and `hash_keys`: the record
/// is in that table of that file, and the file refuses an open without the secret.
#[tokio::test]
async fn sqlite_file_by_url() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("by-url.db");
    let url = format!("sqlite://{}", path.display());
    let idem = Idem::builder()
        .table("by_url_idem")
        .hash_keys(SECRET)
        .connect(&url)
        .await
        .unwrap();
    call_and_replay(&idem, "s-1").await;
    // The bare `sqlite:PATH` form opens the same file.
    let again = Idem::builder()
        .table("by_url_idem")
        .hash_keys(SECRET)
        .replay_cache_bytes(0)
        .connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    assert_eq!(runs_of(&again, "s-1").await, 0, "not the same file");

    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM by_url_idem")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "the record is not in the builder's table");
    pool.close().await;
    let unhashed = Idem::builder().table("by_url_idem").sqlite(&url).await;
    assert!(
        matches!(&unhashed, Err(IdemError::Config { message }) if message.contains("hash_keys")),
        "the store was not opened with the builder's `hash_keys`: {unhashed:?}"
    );
}

/// `postgres://` (and `postgresql://`) opens PostgreSQL with the builder's table: the
/// record is in that table, read with sqlx's own PostgreSQL driver.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_by_url() {
    let test = "postgres_by_url";
    if common::postgres_skip(test).is_some() {
        return;
    }
    let url = common::postgres_url();
    let table = common::unique_table(test);
    let opened = Idem::builder().table(&table).connect(&url).await;
    let Some(idem) = common::reached_or_skip(test, "PostgreSQL", &url, opened) else {
        return;
    };
    call_and_replay(&idem, "p-1").await;
    let other_spelling = url.replacen("postgres://", "postgresql://", 1);
    assert!(other_spelling.starts_with("postgresql://"), "{url}");
    let again = Idem::builder()
        .table(&table)
        .replay_cache_bytes(0)
        .connect(&other_spelling)
        .await
        .unwrap();
    assert_eq!(runs_of(&again, "p-1").await, 0, "not the same table");

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (rows,): (i64,) = sqlx::query_as(&format!("SELECT count(*) FROM {table}"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "the record is not in PostgreSQL's `{table}`");
    pool.close().await;
    common::Cleanup::for_table(&table).run().await;
}

/// `mysql://` opens MySQL/MariaDB with the builder's table, and `mariadb://` the same
/// server: the record one wrote replays through the other, and is in the table as
/// sqlx's own MySQL driver reads it.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_and_mariadb_by_url() {
    let test = "mysql_and_mariadb_by_url";
    if common::mysql_skip(test).is_some() {
        return;
    }
    let url = common::mysql_url();
    let table = common::unique_table(test);
    let opened = Idem::builder().table(&table).connect(&url).await;
    let Some(idem) = common::reached_or_skip(test, "MySQL", &url, opened) else {
        return;
    };
    call_and_replay(&idem, "my-1").await;
    let maria_url = url.replacen("mysql://", "mariadb://", 1);
    assert!(maria_url.starts_with("mariadb://"), "{url}");
    let maria = Idem::builder()
        .table(&table)
        .replay_cache_bytes(0)
        .connect(&maria_url)
        .await
        .unwrap();
    assert_eq!(runs_of(&maria, "my-1").await, 0, "not the same table");
    assert_eq!(runs_of(&maria, "my-2").await, 1);

    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    let (rows,): (i64,) = sqlx::query_as(&format!("SELECT count(*) FROM `{table}`"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "the records are not in MySQL's `{table}`");
    pool.close().await;
    common::Cleanup::for_mysql_table(&table).run().await;
}

/// `redis://` opens Redis with the builder's key prefix: the record is a key under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_by_url() {
    let test = "redis_by_url";
    if common::redis_skip(test).is_some() {
        return;
    }
    let url = common::redis_url();
    let prefix = common::unique_prefix(test);
    let opened = Idem::builder().key_prefix(&prefix).connect(&url).await;
    let Some(idem) = common::reached_or_skip(test, "Redis", &url, opened) else {
        return;
    };
    call_and_replay(&idem, "r-1").await;
    let (_, keys) = common::redis_record_keys(&prefix).await;
    assert_eq!(
        keys.len(),
        1,
        "no record under the builder's prefix: {keys:?}"
    );
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

/// `migrate(false)` on Redis writes nothing: a prefix no application opened is refused
/// (and stays empty), one that an application opened is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_without_migrate_writes_nothing() {
    let test = "redis_without_migrate_writes_nothing";
    if common::redis_skip(test).is_some() {
        return;
    }
    let url = common::redis_url();
    let prefix = common::unique_prefix(test);
    let read_only = || Idem::builder().key_prefix(&prefix).migrate(false);
    let message = match read_only().connect(&url).await {
        Err(IdemError::Config { message }) => message,
        Err(e) => panic!("Redis at {url}: {e}"),
        Ok(_) => panic!("opened an idem store under a prefix nobody opened"),
    };
    assert!(
        message.contains("no idem store under the Redis key prefix"),
        "{message}"
    );
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let written: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(written.is_empty(), "wrote {written:?}");

    let app = Idem::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    assert_eq!(runs_of(&app, "w-1").await, 1);
    let reader = read_only().connect(&url).await.unwrap();
    assert_eq!(runs_of(&reader, "w-1").await, 0);
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

/// `redis+cluster://HOST:PORT,...` (and the nodes' URLs separated by commas) opens the
/// store on a Redis Cluster: calls on keys of every master's slots succeed, which a
/// connection to one node alone would have refused with `MOVED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_by_url() {
    let Some(cluster) = idem_test_support::RedisCluster::start("redis_cluster_by_url").await else {
        return;
    };
    let hosts: Vec<String> = cluster
        .ports()
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let idem = Idem::builder()
        .key_prefix("by-url")
        .connect(&format!("redis+cluster://{}", hosts.join(",")))
        .await
        .unwrap();
    for i in 0..24 {
        call_and_replay(&idem, &format!("c-{i}")).await;
    }
    let by_urls = Idem::builder()
        .key_prefix("by-url")
        .replay_cache_bytes(0)
        .connect(&cluster.urls().join(","))
        .await
        .unwrap();
    for i in 0..24 {
        assert_eq!(runs_of(&by_urls, &format!("c-{i}")).await, 0);
    }
    let mut holding = 0;
    for url in cluster.urls() {
        let client = redis::Client::open(url).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let keys: u64 = redis::cmd("DBSIZE").query_async(&mut c).await.unwrap();
        holding += usize::from(keys > 0);
    }
    assert_eq!(
        holding, 3,
        "the records are not spread over the cluster's masters"
    );
}

/// A port on 127.0.0.1 where nothing listens.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Opens that fail say where, or which scheme, and never the URL's password.
#[tokio::test]
async fn failures_name_the_place_not_the_password() {
    let port = closed_port();
    let mut urls = vec![
        format!("redis://:hunter2@127.0.0.1:{port}/0?password=hunter2"),
        format!("redis+cluster://u:hunter2@127.0.0.1:{port},127.0.0.1:{port}"),
    ];
    if cfg!(feature = "postgres") {
        urls.push(format!("postgres://u:hunter2@127.0.0.1:{port}/db"));
    }
    if cfg!(feature = "mysql") {
        urls.push(format!("mariadb://u:hunter2@127.0.0.1:{port}/db"));
    }
    for url in &urls {
        let opened = tokio::time::timeout(Duration::from_secs(20), Idem::connect(url))
            .await
            .expect("the open waited instead of reporting the refusal");
        let message = opened.expect_err(url).to_string();
        assert!(
            message.contains(&format!("127.0.0.1:{port}")),
            "{url}: {message}"
        );
        assert!(!message.contains("hunter2"), "{url}: {message}");
    }
    let unknown = Idem::connect("mongodb://u:hunter2@127.0.0.1/db").await;
    let message = unknown.expect_err("mongodb").to_string();
    assert!(
        message.contains("`mongodb://`") && message.contains("postgres://"),
        "{message}"
    );
    assert!(!message.contains("hunter2"), "{message}");
}
