//! The `idem` binary against a real SQLite file and a real PostgreSQL database: every
//! subcommand, `--json` parsed back, exit codes, and a resolve that races a claimant.

use std::process::Output;
use std::time::Duration;

use idem_runtime::{Disposition, Idem, IdemError, InFlight};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: u64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize, thiserror::Error)]
enum PayError {
    #[error("provider timed out")]
    Timeout,
    #[error("{0}")]
    Idem(String),
}

impl From<IdemError> for PayError {
    fn from(e: IdemError) -> Self {
        PayError::Idem(e.to_string())
    }
}

fn idem_cmd(url: &str, table: &str, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--url", url, "--table", table])
        .args(args)
        .env_remove("IDEM_URL")
        .output()
        .expect("run the idem binary")
}

/// Runs `idem --json ARGS`, expects exit code `code`, and parses stdout.
fn json(url: &str, table: &str, args: &[&str], code: i32) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = idem_cmd(url, table, &all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(code),
        "idem {args:?}: stdout {stdout}, stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

async fn charge(idem: &Idem, order: &str, unknown: bool) -> Result<Receipt, PayError> {
    idem.operation("charge", order)
        .scope("acme")
        .classify(|e: &PayError| match e {
            PayError::Timeout => Disposition::Unknown,
            PayError::Idem(_) => Disposition::Release,
        })
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async move {
            if unknown {
                Err(PayError::Timeout)
            } else {
                Ok(Receipt { id: 1 })
            }
        })
        .await
}

/// The whole operator flow on one store: `url` and `table` name what `idem` opens,
/// `idem` is the application's handle on the same records.
async fn operator_flow(url: &str, table: &str, idem: &Idem) {
    charge(idem, "order-1", false).await.unwrap();
    assert_eq!(
        charge(idem, "order-2", true).await,
        Err(PayError::Timeout),
        "the provider timed out: UNKNOWN"
    );

    let stats = json(url, table, &["stats"], 0);
    assert_eq!(
        (stats["completed"].as_u64(), stats["unknown"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(stats["oldest_unknown_ms"].is_u64());
    assert!(stats["oldest_in_progress_ms"].is_null());

    let rows = json(
        url,
        table,
        &["list", "--state", "unknown", "--scope", "acme"],
        0,
    );
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["name"], "charge");
    assert_eq!(rows[0]["state"], "unknown");
    let unknown_epoch = rows[0]["epoch"].as_u64().unwrap();
    let other_scope = json(url, table, &["list", "--scope", "globex"], 0);
    assert_eq!(other_scope, Value::Array(vec![]), "scope filter");

    let shown = json(url, table, &["show", "acme", "charge", "order-1"], 0);
    assert_eq!(shown["state"], "completed");
    assert_eq!(shown["outcome"]["body"], serde_json::json!({ "id": 1 }));
    assert!(shown["expires_in_ms"].as_u64().unwrap() > 0);
    // The key copied from `list` works with --encoded.
    let encoded = json(
        url,
        table,
        &[
            "show",
            rows[0]["scope"].as_str().unwrap(),
            "charge",
            rows[0]["key"].as_str().unwrap(),
            "--encoded",
        ],
        0,
    );
    assert_eq!(encoded["state"], "unknown");

    // No such record: exit 3.
    json(url, table, &["show", "acme", "charge", "order-404"], 3);
    json(url, table, &["show", "acme", "charge", "1", "--int-key"], 3);

    // The operator checked the provider: the charge happened.
    let stale = (unknown_epoch + 1).to_string();
    let refused = json(
        url,
        table,
        &[
            "resolve",
            "acme",
            "charge",
            "order-2",
            "--completed",
            r#"{"id":9}"#,
            "--epoch",
            &stale,
        ],
        4,
    );
    assert!(refused["error"].as_str().unwrap().contains("epoch"));
    json(
        url,
        table,
        &[
            "resolve",
            "acme",
            "charge",
            "order-2",
            "--completed",
            "not json",
        ],
        2,
    );
    let done = json(
        url,
        table,
        &[
            "resolve",
            "acme",
            "charge",
            "order-2",
            "--completed",
            r#"{"id":9}"#,
        ],
        0,
    );
    assert_eq!(done["resolved"], "completed");
    assert_eq!(
        charge(idem, "order-2", true).await,
        Ok(Receipt { id: 9 }),
        "the resolution replays, the body does not run"
    );
    // Resolving a completed record is refused.
    json(
        url,
        table,
        &["resolve", "acme", "charge", "order-2", "--retry"],
        4,
    );

    // A stuck claim: the operator reads it, a claimant takes it over meanwhile, and the
    // operator's resolve at the epoch read is refused; the new claim stands.
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let stuck = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation("charge", "order-3")
                .scope("acme")
                .lease(Duration::from_millis(300))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async move {
                    started_tx.send(()).unwrap();
                    std::future::pending::<()>().await;
                    Ok::<_, IdemError>(Receipt { id: 3 })
                })
                .await
        })
    };
    started.await.unwrap();
    stuck.abort();
    let read = json(url, table, &["show", "acme", "charge", "order-3"], 0);
    assert_eq!(read["state"], "in_progress");
    let read_epoch = read["epoch"].as_u64().unwrap().to_string();
    let taken = loop {
        let r = idem
            .operation("charge", "order-3")
            .scope("acme")
            .in_flight(InFlight::Reject)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(Receipt { id: 33 }) })
            .await;
        match r {
            Err(IdemError::InFlight { retry_after, .. }) => tokio::time::sleep(retry_after).await,
            other => break other.unwrap(),
        }
    };
    assert_eq!(taken, Receipt { id: 33 });
    json(
        url,
        table,
        &[
            "resolve",
            "acme",
            "charge",
            "order-3",
            "--retry",
            "--epoch",
            &read_epoch,
        ],
        4,
    );
    let after = json(url, table, &["show", "acme", "charge", "order-3"], 0);
    assert_eq!(after["state"], "completed");
    assert_eq!(after["outcome"]["body"], serde_json::json!({ "id": 33 }));

    let purged = json(url, table, &["purge"], 0);
    assert_eq!(purged["purged"], 0, "nothing has expired");

    // People get tables.
    let out = idem_cmd(url, table, &["stats"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("completed") && text.contains("unknown"),
        "{text}"
    );
}

#[tokio::test]
async fn every_subcommand_on_a_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let url = format!("sqlite://{}", path.display());
    let idem = Idem::builder()
        .table("payments_idem")
        .sqlite(&format!("{url}?mode=rwc"))
        .await
        .unwrap();
    operator_flow(&url, "payments_idem", &idem).await;

    // The default table does not exist in this file: a clear error, nothing created.
    let out = idem_cmd(&url, "idem_operations", &["stats"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("idem_operations") && err.contains("--table"),
        "{err}"
    );
}

#[tokio::test]
async fn every_subcommand_on_postgres() {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let table = format!("cli_{}", std::process::id());
    let idem = match Idem::builder().table(&table).postgres(&url).await {
        Ok(idem) => idem,
        Err(e) if std::env::var("IDEM_REQUIRE_DB").is_ok_and(|v| v == "1") => {
            panic!("PostgreSQL is required (IDEM_REQUIRE_DB=1) but not reachable: {e}")
        }
        Err(e) => {
            eprintln!("skipping: PostgreSQL not reachable at {url} ({e})");
            return;
        }
    };
    operator_flow(&url, &table, &idem).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(&format!("DROP TABLE {table}, {table}_meta CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(&format!("DROP SEQUENCE IF EXISTS {table}_epoch_seq"))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn every_subcommand_on_mysql() {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let table = format!("cli_{}", std::process::id());
    let idem = match Idem::builder().table(&table).mysql(&url).await {
        Ok(idem) => idem,
        Err(e) if std::env::var("IDEM_REQUIRE_DB").is_ok_and(|v| v == "1") => {
            panic!("MySQL is required (IDEM_REQUIRE_DB=1) but not reachable: {e}")
        }
        Err(e) => {
            eprintln!("skipping: MySQL not reachable at {url} ({e})");
            return;
        }
    };
    operator_flow(&url, &table, &idem).await;
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    sqlx::query(&format!(
        "DROP TABLE `{table}`, `{table}_meta`, `{table}_epoch_seq`"
    ))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = ?")
        .bind(&table)
        .execute(&pool)
        .await
        .unwrap();
}

#[test]
fn bad_urls_and_arguments_say_what_to_do() {
    let out = idem_cmd("redis://x", "t", &["stats"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected sqlite://PATH"));

    let out = idem_cmd("sqlite:///nonexistent/dir/app.db", "t", &["stats"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no SQLite database"));

    // clap's own usage errors: a resolve needs exactly one resolution.
    let out = idem_cmd("sqlite://x", "t", &["resolve", "s", "n", "k"]);
    assert_eq!(out.status.code(), Some(2));
    let out = idem_cmd(
        "sqlite://x",
        "t",
        &["resolve", "s", "n", "k", "--retry", "--completed", "1"],
    );
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn schema_prints_the_ddl_for_a_table() {
    for (dialect, needle) in [
        ("sqlite", "CREATE TABLE"),
        ("postgres", "CREATE TABLE"),
        ("mysql", "ENGINE = InnoDB"),
    ] {
        let out = idem_cmd("unused://", "orders_idem", &["schema", dialect]);
        assert!(out.status.success());
        let sql = String::from_utf8_lossy(&out.stdout);
        assert!(sql.contains(needle) && sql.contains("orders_idem"), "{sql}");
        assert!(
            !sql.contains("idem_operations"),
            "renamed throughout: {sql}"
        );
    }
}

/// The secret in the URLs below, in each spelling a message could show.
const URL_SECRETS: [&str; 3] = ["hunter2", "s3cr", "pa?ss"];

fn assert_no_secret(what: &str, text: &str) {
    for secret in URL_SECRETS {
        assert!(!text.contains(secret), "{what} shows `{secret}`: {text}");
    }
}

/// A store URL may hold a password: the unsupported-URL message names its scheme only,
/// connection errors redact it (in the user info, unencoded, or as a query parameter),
/// and `--help` names `IDEM_URL` without printing its value.
#[test]
fn no_message_shows_the_urls_password() {
    for url in [
        "redis://:hunter2@127.0.0.1:6379",
        "http://u:hunter2@h/x?password=hunter2",
        "u:hunter2@db/app",
    ] {
        let out = idem_cmd(url, "t", &["stats"]);
        assert_eq!(out.status.code(), Some(2), "{url}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("unsupported store URL"), "{err}");
        assert_no_secret(url, &err);
    }
    let out = idem_cmd("redis://:hunter2@h", "t", &["stats"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("`redis://`"));

    // Nothing listens on port 1: the connect error quotes the URL, redacted.
    for url in [
        "postgres://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
        "postgres://u:pa?ss@127.0.0.1:1/db",
        "mysql://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
    ] {
        let out = idem_cmd(url, "t", &["stats"]);
        assert_eq!(out.status.code(), Some(1), "{url}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("127.0.0.1"), "{err}");
        assert_no_secret(url, &err);
        let out = idem_cmd(url, "t", &["--json", "stats"]);
        assert_no_secret(url, &String::from_utf8_lossy(&out.stdout));
    }

    for args in [&["--help"][..], &["stats", "--help"], &["-h"]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .env("IDEM_URL", "postgres://u:hunter2@127.0.0.1/db")
            .output()
            .expect("run the idem binary");
        assert!(out.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.contains("IDEM_URL"), "{help}");
        assert_no_secret("--help", &help);
    }
}

/// Whether `bytes` holds a control byte other than a newline (ESC, CR, BEL, DEL, ...).
fn has_control(bytes: &[u8]) -> bool {
    bytes.iter().any(|&b| (b < 0x20 && b != b'\n') || b == 0x7f)
}

/// A stored key holding ESC and CR (clear the screen, return to the start of the line
/// and print over it) is shown escaped by `list` and `show`, so it cannot rewrite the
/// operator's screen; `--json` keeps the key exact.
#[tokio::test]
async fn list_and_show_escape_control_characters() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let idem = Idem::sqlite(&format!("{url}?mode=rwc")).await.unwrap();
    let key = "k\x1b[2J\rorder-1 completed";
    let scope = "acme\x07\u{202e}";
    idem.operation("charge\x1b[1A", key)
        .scope(scope)
        .retain(Duration::from_secs(3600))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(1) })
        .await
        .unwrap();

    let table = "idem_operations";
    for args in [
        &["list"][..],
        &["show", scope, "charge\x1b[1A", key],
        &["show", scope, "charge\x1b[1A", "k\x1b[2J\rmissing"],
    ] {
        let out = idem_cmd(&url, table, args);
        for (stream, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            assert!(
                !has_control(bytes),
                "idem {args:?} wrote a control byte to {stream}: {:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }
    let out = idem_cmd(&url, table, &["list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(r"k\u{1b}[2J\rorder-1 completed") && text.contains(r"acme\u{7}\u{202e}"),
        "{text}"
    );
    let rows = json(&url, table, &["list"], 0);
    assert_eq!(rows[0]["key"], format!("s{}:{key}", key.len()));
}
