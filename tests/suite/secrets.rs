//! What a stolen table or an error message gives away: under `hash_keys` the stored
//! fingerprint is keyed on every store, and no message repeats a database password.
use crate::common;

use std::time::Duration;

use common::Counter;
use idem_runtime::{Idem, IdemBuilder, IdemError};

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

/// The request a dictionary attack on an unkeyed fingerprint recovered.
fn request(cents: u64) -> (&'static str, u64, u64) {
    ("acme-corp", 48213, cents)
}

async fn charge(idem: &Idem, cents: u64, runs: &Counter) -> Result<u64, IdemError> {
    let request = request(cents);
    idem.operation("charge", &request.1)
        .scope(request.0)
        .retain(Duration::from_secs(3600))
        .fingerprint(&request)
        .run(|| async move {
            runs.hit();
            Ok::<_, IdemError>(cents)
        })
        .await
}

/// One charge recorded, then replayed and refused with another payload on `idem` and
/// on `uncached`, a handle on the same records without the replay cache (so the store
/// decides).
async fn charge_replay_and_mismatch(store: &str, idem: &Idem, uncached: &Idem) {
    let runs = Counter::default();
    assert_eq!(charge(idem, 2500, &runs).await.unwrap(), 2500, "{store}");
    for handle in [idem, uncached] {
        assert_eq!(charge(handle, 2500, &runs).await.unwrap(), 2500, "{store}");
        let other = charge(handle, 9999, &runs).await;
        assert!(
            matches!(other, Err(IdemError::Mismatch { .. })),
            "{store}: {other:?}"
        );
    }
    assert_eq!(runs.get(), 1, "{store}: the body ran again");
}

/// Two handles on the store `open` opens, under `hash_keys`: one with the replay cache,
/// one without.
async fn open_twice<F, Fut>(open: F) -> (Idem, Idem)
where
    F: Fn(IdemBuilder) -> Fut,
    Fut: std::future::Future<Output = Result<Idem, IdemError>>,
{
    let cached = open(Idem::builder().hash_keys(SECRET)).await.unwrap();
    let uncached = open(Idem::builder().hash_keys(SECRET).replay_cache_bytes(0))
        .await
        .unwrap();
    (cached, uncached)
}

/// The fingerprint of the one record under the Redis `prefix`.
async fn redis_fingerprint(prefix: &str) -> Vec<u8> {
    let (mut c, keys) = common::redis_record_keys(prefix).await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    redis::cmd("HGET")
        .arg(&keys[0])
        .arg("fp")
        .query_async(&mut c)
        .await
        .unwrap()
}

/// Under `hash_keys` every store holds the same keyed fingerprint (the runtime's unit
/// test pins it to HMAC-SHA256 under a key derived from the secret), never the plain
/// SHA-256 of the canonical encoding; replays and mismatches work as without it, on
/// the memory store too.
#[tokio::test]
async fn hashed_keys_store_a_keyed_fingerprint_on_every_store() {
    let test = "hashed_keys_store_a_keyed_fingerprint_on_every_store";
    let plain = idem_runtime::fingerprint(&request(2500)).unwrap().to_vec();
    let mut stored: Vec<(&str, Vec<u8>)> = Vec::new();

    // The memory store's records live in its handle, and it has no replay cache.
    let memory = Idem::builder().hash_keys(SECRET).memory();
    charge_replay_and_mismatch("memory", &memory, &memory).await;

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    let (idem, uncached) = open_twice(|b| b.sqlite(&url)).await;
    charge_replay_and_mismatch("sqlite", &idem, &uncached).await;
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let fp = sqlx::query_scalar("SELECT fingerprint FROM idem_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    stored.push(("sqlite", fp));

    #[cfg(feature = "postgres")]
    if common::postgres_skip(test).is_none() {
        let url = common::postgres_url();
        let table = common::unique_table(test);
        let (idem, uncached) = open_twice(|b| b.table(table.clone()).postgres(&url)).await;
        charge_replay_and_mismatch("postgres", &idem, &uncached).await;
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let fp = sqlx::query_scalar(&format!("SELECT fingerprint FROM {table}"))
            .fetch_one(&pool)
            .await
            .unwrap();
        stored.push(("postgres", fp));
        common::Cleanup::for_table(&table).run().await;
    }

    #[cfg(feature = "mysql")]
    if common::mysql_skip(test).is_none() {
        let url = common::mysql_url();
        let table = common::unique_table(test);
        let (idem, uncached) = open_twice(|b| b.table(table.clone()).mysql(&url)).await;
        charge_replay_and_mismatch("mysql", &idem, &uncached).await;
        let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
        let fp = sqlx::query_scalar(&format!("SELECT fingerprint FROM `{table}`"))
            .fetch_one(&pool)
            .await
            .unwrap();
        stored.push(("mysql", fp));
        common::Cleanup::for_mysql_table(&table).run().await;
    }

    if common::redis_skip(test).is_none() {
        let prefix = common::unique_prefix(test);
        let url = common::redis_url();
        let (idem, uncached) = open_twice(|b| b.key_prefix(prefix.clone()).redis(&url)).await;
        charge_replay_and_mismatch("redis", &idem, &uncached).await;
        stored.push(("redis", redis_fingerprint(&prefix).await));
        common::Cleanup::for_redis_prefix(&prefix).run().await;
    }

    for (store, fp) in &stored {
        assert_ne!(fp, &plain, "{store} stored the plain SHA-256");
        assert_eq!(
            fp, &stored[0].1,
            "{store} and {} store different fingerprints",
            stored[0].0
        );
    }
}

/// The secrets in the URLs below, in every spelling a message could show them.
const SECRETS: [&str; 6] = ["s3cr", "hunter2", "pa?ss", "pa%3Fss", "p#w", "p%23w"];

fn assert_hidden(url: &str, e: &IdemError) {
    let mut texts = vec![e.to_string(), format!("{e:?}")];
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        texts.push(s.to_string());
        source = s.source();
    }
    for text in texts {
        for secret in SECRETS {
            assert!(!text.contains(secret), "{url}: `{secret}` shown in {text}");
        }
    }
}

/// Opening a server store with a password in the URL (percent-encoded, unencoded with a
/// character that ends the user info early, or as a query parameter) fails without
/// repeating it, whether the URL is refused or the server does not answer (port 1).
#[tokio::test]
async fn open_errors_never_show_the_password() {
    #[cfg(feature = "postgres")]
    for url in [
        "postgres://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
        "postgres://u@127.0.0.1:1/db?sslmode=disable&password=hunter2",
        "postgres://u:pa?ss@127.0.0.1:1/db",
        "postgres://u:p#w@127.0.0.1:1/db",
        "postgres://u:s3cr/t@127.0.0.1:1/db",
    ] {
        match Idem::postgres(url).await {
            Ok(_) => panic!("{url} opened"),
            Err(e) => assert_hidden(url, &e),
        }
    }
    #[cfg(feature = "mysql")]
    for url in [
        "mysql://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
        "mysql://u:pa?ss@127.0.0.1:1/db",
        "mysql://u:s3cr/t@127.0.0.1:1/db",
    ] {
        match Idem::mysql(url).await {
            Ok(_) => panic!("{url} opened"),
            Err(e) => assert_hidden(url, &e),
        }
    }
    for url in [
        "redis://:hunter2@127.0.0.1:1",
        "redis://u:s3cr%2Ft@127.0.0.1:1/0",
    ] {
        match Idem::redis(url).await {
            Ok(_) => panic!("{url} opened"),
            Err(e) => assert_hidden(url, &e),
        }
    }
}
