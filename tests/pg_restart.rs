//! A PostgreSQL server restarted under load: the test runs its own server (`initdb`
//! into a temporary folder, `pg_ctl` on a spare port of 127.0.0.1), never the shared
//! one, and crashes it (`-m immediate`) in the middle of 1,000 keyed calls.
#![cfg(feature = "postgres")]
mod common;
#[path = "common/provider.rs"]
mod provider;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use idem_runtime::{Idem, IdemError, InFlight, OnStoreError, current};
use provider::Provider;

/// A PostgreSQL server of this test's own.
struct OwnServer {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

fn as_postgres(bin: &Path, program: &str) -> Command {
    let path = bin.join(program);
    // initdb and postgres refuse to run as root.
    if std::env::var("USER").is_ok_and(|u| u == "root") || is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(path);
        cmd
    } else {
        Command::new(path)
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn postgres_bin() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|p| p.join("pg_ctl").exists())
        .collect();
    dirs.sort();
    dirs.pop()
}

impl OwnServer {
    fn start() -> Option<OwnServer> {
        let Some(bin) = postgres_bin() else {
            assert!(
                !db_required(),
                "IDEM_REQUIRE_DB=1 but no PostgreSQL binaries in /usr/lib/postgresql"
            );
            skip(
                "pg_restart",
                "no PostgreSQL binaries (initdb, pg_ctl) in /usr/lib/postgresql",
            );
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        if is_root() {
            // The server's own user must own its folder.
            for p in [dir.path(), data.as_path()] {
                let ok = Command::new("chown")
                    .args(["postgres:postgres"])
                    .arg(p)
                    .status()
                    .unwrap();
                assert!(ok.success());
            }
        }
        let ok = as_postgres(&bin, "initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            ok.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let server = OwnServer {
            bin,
            data,
            port,
            _dir: dir,
        };
        server.pg_ctl(&["start", "-w"]);
        Some(server)
    }

    fn pg_ctl(&self, args: &[&str]) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c max_connections=60",
            self.port,
            self.data.display()
        );
        let out = as_postgres(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.data.join("server.log"))
            .args(["-o", &options])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = as_postgres(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .output();
    }
}

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
    let Some(server) = OwnServer::start() else {
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
