//! A PostgreSQL server restarted under load: the test runs its own server (`initdb`
//! into a temporary folder, `pg_ctl` on a spare port of 127.0.0.1), never the shared
//! one, and crashes it (`-m immediate`) in the middle of 1,000 keyed calls.
#![cfg(feature = "postgres")]
use crate::own_servers;
use crate::provider;

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_runtime::{Idem, IdemError, InFlight, OnStoreError, current};
use own_servers::OwnPostgres;
use provider::Provider;

/// Collects formatted events, to see the fail_open warning.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<u8>>>);

impl Write for Events {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The body: one charge at the provider, keyed by the operation's downstream key.
async fn charge(http: reqwest::Client, url: String, key: usize) -> Result<usize, IdemError> {
    let res = http
        .post(format!("{url}/charges"))
        .header("Idempotency-Key", current().downstream_key("provider"))
        .json(&serde_json::json!({ "amount_cents": key }))
        .send()
        .await
        .map_err(|e| IdemError::Config {
            message: e.to_string(),
        })?;
    assert!(res.status().is_success());
    Ok(key)
}

const KEYS: usize = 1000;
const CALLERS: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_mid_run_loses_nothing_and_duplicates_nothing() {
    let Some(server) = OwnPostgres::start("pg_restart", &["max_connections=60"]) else {
        return;
    };
    let events = Events::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let events = events.clone();
            move || events.clone()
        })
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let provider = Provider::start().await;
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .postgres(&server.url())
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let outage_errors = Arc::new(AtomicU64::new(0));
    // The second half of the keys waits for the crash, so that callers are still at work
    // when the server dies however fast the first half goes.
    let (crashed, after_crash) = tokio::sync::watch::channel(false);
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (idem, next, done, errors, mut after_crash) = (
                idem.clone(),
                next.clone(),
                done.clone(),
                outage_errors.clone(),
                after_crash.clone(),
            );
            let (http, url) = (http.clone(), provider.url());
            tokio::spawn(async move {
                loop {
                    let key = next.fetch_add(1, Ordering::SeqCst);
                    if key >= KEYS {
                        return;
                    }
                    if key >= KEYS / 2 {
                        after_crash.wait_for(|c| *c).await.unwrap();
                    }
                    loop {
                        let r = idem
                            .operation("charge", &key)
                            .lease(Duration::from_secs(1))
                            .in_flight(InFlight::Reject)
                            .retain(std::time::Duration::from_secs(86_400))
                            .fingerprint_none()
                            .run(|| charge(http.clone(), url.clone(), key))
                            .await;
                        match r {
                            Ok(k) => {
                                assert_eq!(k, key);
                                break;
                            }
                            // The outage: the body did not run, or ran and its outcome
                            // waits for its lease to lapse and a retry to take over.
                            Err(IdemError::Store { .. } | IdemError::Unrecorded { .. }) => {
                                errors.fetch_add(1, Ordering::SeqCst);
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            Err(IdemError::InFlight { retry_after, .. }) => {
                                tokio::time::sleep(retry_after).await
                            }
                            Err(e) => panic!("key {key}: {e}"),
                        }
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();

    let run = async {
        while done.load(Ordering::SeqCst) < KEYS / 3 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // A crash, not a clean shutdown: connections die mid-statement.
        server.pg_ctl(&["-m", "immediate", "stop"]);
        crashed.send(true).unwrap();

        let ran = Arc::new(AtomicUsize::new(0));
        let probe = |policy: OnStoreError| {
            let ran = ran.clone();
            idem.operation("probe", "while-down")
                .on_store_error(policy)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, IdemError>(())
                })
        };
        let closed = probe(OnStoreError::FailClosed).await;
        assert!(matches!(closed, Err(IdemError::Store { .. })), "{closed:?}");
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "fail_closed never runs the body"
        );
        probe(OnStoreError::FailOpen).await.unwrap();
        assert_eq!(
            ran.load(Ordering::SeqCst),
            1,
            "fail_open runs it unprotected"
        );
        let logged = String::from_utf8_lossy(&events.0.lock().unwrap()).into_owned();
        assert!(
            logged.contains("fail_open") && logged.contains("WARN"),
            "{logged}"
        );

        // Down until callers have met the outage, however quickly the probes above ran
        // (or until none is left to meet it: a caller that panicked is reported below).
        while outage_errors.load(Ordering::SeqCst) == 0 && !callers.iter().all(|c| c.is_finished())
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        server.pg_ctl(&["start", "-w"]);
        for caller in callers {
            caller.await.unwrap();
        }
    };
    // A bound on the whole run: a hang is a failure, not a stuck CI job.
    tokio::time::timeout(Duration::from_secs(600), run)
        .await
        .expect("calls resumed after the restart");

    assert!(
        outage_errors.load(Ordering::SeqCst) > 0,
        "callers saw the outage"
    );
    let pool = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let (completed, total): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 1), count(*) FROM idem_operations WHERE name = 'charge'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (completed, total),
        (KEYS as i64, KEYS as i64),
        "one completed record per key"
    );
    assert_eq!(provider.effects(), KEYS, "one effect per key");
    for key in 0..KEYS {
        let downstream = idem
            .operation("charge", &key)
            .id()
            .downstream_key("provider");
        assert!(provider.charge(&downstream).is_some(), "key {key} charged");
    }
}
