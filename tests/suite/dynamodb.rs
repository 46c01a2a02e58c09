//! The DynamoDB store against a local DynamoDB-compatible server (moto's, started by
//! `.ci/services.sh`; `IDEM_DYNAMODB_URL`): the whole conformance suite, steps
//! included; many callers on one key and on many keys; hashed keys; and the table
//! names `dynamodb://TABLE` takes.
use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};

use idem_runtime::store::conformance;
use idem_runtime::store::dynamodb::DynamoStore;
use idem_runtime::{Idem, IdemError};
use idem_test_support::{db_required, dynamodb_url, skip};

#[path = "../common/dynamodb_client.rs"]
mod local;
pub(crate) use local::client;

/// Whether the local server listens; a test skips with one line without it, or fails
/// under `IDEM_REQUIRE_DB=1`.
pub(crate) fn reachable(test: &str) -> bool {
    use std::net::ToSocketAddrs;
    let url = dynamodb_url();
    let addr = url
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_owned();
    let up = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| {
            std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_millis(500)).is_ok()
        });
    if !up {
        assert!(
            !db_required(),
            "IDEM_REQUIRE_DB=1 but no DynamoDB-compatible server listens at {url} (needed by \
             {test}); `.ci/services.sh` starts moto's"
        );
        skip(
            test,
            &format!("no DynamoDB-compatible server at {url}; set IDEM_DYNAMODB_URL"),
        );
    }
    up
}

/// A table no other test (or earlier run) uses.
pub(crate) fn table(test: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("idem-{test}-{nanos}-{n}")
}

pub(crate) async fn drop_table(name: &str) {
    let _ = client().delete_table().table_name(name).send().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_store_conforms() {
    if !reachable("dynamodb_store_conforms") {
        return;
    }
    let name = table("conforms");
    // Opened as an application opens it, which creates the table.
    let idem = Idem::dynamodb(client(), &name).await.unwrap();
    conformance::run_all(&DynamoStore::new(client(), &name)).await;
    drop(idem);
    drop_table(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_callers_on_one_key_and_on_many_run_each_once() {
    if !reachable("dynamodb_contention") {
        return;
    }
    let name = table("contention");
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .dynamodb(client(), &name)
        .await
        .unwrap();
    common::contend_one_key(&idem, 16, 2).await;
    let runs = common::contend_many_keys(&idem, 20, 4).await;
    assert_eq!(runs, 20, "one run per key");
    drop_table(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashed_keys_are_recorded_and_a_changed_secret_is_refused() {
    if !reachable("dynamodb_hash_keys") {
        return;
    }
    let name = table("hashed");
    let secret = [9u8; 32];
    let idem = Idem::builder()
        .hash_keys(secret)
        .dynamodb(client(), &name)
        .await
        .unwrap();
    let call = |idem: &Idem| {
        idem.operation("charge", "customer@example.com")
            .retain(std::time::Duration::from_secs(3600))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(7) })
    };
    assert_eq!(call(&idem).await.unwrap(), 7);
    let listed = idem.list(&Default::default()).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        !listed[0].id.key.contains("example.com"),
        "{:?}",
        listed[0].id
    );
    let plain = Idem::dynamodb(client(), &name).await.unwrap_err();
    assert!(matches!(plain, IdemError::Config { .. }), "{plain}");
    drop_table(&name).await;
}

#[tokio::test]
async fn a_bad_table_name_in_a_url_is_refused_before_anything_opens() {
    let refused = Idem::connect("dynamodb://a").await.unwrap_err();
    assert!(refused.to_string().contains("3 to 255"), "{refused}");
    let refused = Idem::connect("dynamodb://orders/idem").await.unwrap_err();
    assert!(matches!(refused, IdemError::Config { .. }), "{refused}");
}
