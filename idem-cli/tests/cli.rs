//! The `idem` binary against a real SQLite file and a real PostgreSQL database: every
//! subcommand, `--json` parsed back, exit codes, and a resolve that races a claimant.

use std::process::Output;
use std::time::Duration;

use idem_runtime::{Disposition, Idem, IdemError, InFlight};
use idem_test_support::{
    RedisCluster, db_required, delete_redis_prefix, mysql_url, postgres_url, reached_or_skip,
    redis_url, skip, unique_prefix,
};
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

/// Runs `idem` with `args` against the store `store` names (`--url ...`, `--node ...`,
/// `--table`, `--key-prefix`), with no store in the environment.
fn idem(store: &[String], args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(store)
        .args(args)
        .env_remove("IDEM_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run the idem binary")
}

fn sql_store(url: &str, table: &str) -> Vec<String> {
    ["--url", url, "--table", table].map(String::from).to_vec()
}

fn idem_cmd(url: &str, table: &str, args: &[&str]) -> Output {
    idem(&sql_store(url, table), args)
}

/// Runs `idem --json ARGS` on `store`, expects exit code `code`, and parses stdout.
fn json_on(store: &[String], args: &[&str], code: i32) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = idem(store, &all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(code),
        "idem {args:?}: stdout {stdout}, stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn json(url: &str, table: &str, args: &[&str], code: i32) -> Value {
    json_on(&sql_store(url, table), args, code)
}

/// Runs `idem ARGS` on `store` for people, expects exit code `code`, and returns stdout
/// and stderr.
fn text_on(store: &[String], args: &[&str], code: i32) -> (String, String) {
    let out = idem(store, args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "idem {args:?}: stdout {stdout}, stderr {stderr}"
    );
    (stdout, stderr)
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
            // A step before the call that times out: UNKNOWN lists it for the operator.
            let hold: u64 =
                idem_runtime::step("authorize", || async { Ok::<_, PayError>(7) }).await?;
            if unknown {
                Err(PayError::Timeout)
            } else {
                Ok(Receipt { id: hold - 6 })
            }
        })
        .await
}

/// A `charge` of `order` under a lease of `lease` whose body never ends: returns once the
/// body runs, with its task to abort.
async fn hanging_charge(
    idem: &Idem,
    order: &'static str,
    lease: Duration,
) -> tokio::task::JoinHandle<Result<Receipt, IdemError>> {
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let idem = idem.clone();
    let task = tokio::spawn(async move {
        idem.operation("charge", order)
            .scope("acme")
            .lease(lease)
            .retain(Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async move {
                started_tx.send(()).unwrap();
                std::future::pending::<()>().await;
                Ok::<_, IdemError>(Receipt { id: 0 })
            })
            .await
    });
    started.await.unwrap();
    task
}

/// Records of `refund` under keys of several types, all in scope `acme`.
async fn typed_keys(idem: &Idem) {
    async fn refund<K: idem_runtime::KeyPart + ?Sized>(idem: &Idem, key: &K) {
        idem.operation("refund", key)
            .scope("acme")
            .retain(Duration::from_secs(3600))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(()) })
            .await
            .unwrap();
    }
    refund(idem, &42i64).await;
    refund(idem, "42").await;
    refund(idem, &("acme", 7u32)).await;
    refund(idem, "two words").await;
}

/// The line of `text` that holds every one of `parts`.
fn line_with<'t>(text: &'t str, parts: &[&str]) -> &'t str {
    text.lines()
        .find(|l| parts.iter().all(|p| l.contains(p)))
        .unwrap_or_else(|| panic!("no line with {parts:?} in:\n{text}"))
}

/// The whole operator flow on one store: `store` names what `idem` opens, `idem` is the
/// application's handle on the same records.
async fn operator_flow(store: &[String], idem: &Idem) {
    let json = |args: &[&str], code: i32| json_on(store, args, code);
    let text = |args: &[&str], code: i32| text_on(store, args, code);
    charge(idem, "order-1", false).await.unwrap();
    assert_eq!(
        charge(idem, "order-2", true).await,
        Err(PayError::Timeout),
        "the provider timed out: UNKNOWN"
    );

    let stats = json(&["stats"], 0);
    assert_eq!(
        (stats["completed"].as_u64(), stats["unknown"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(stats["oldest_unknown_ms"].is_u64());
    assert!(stats["oldest_in_progress_ms"].is_null());

    let rows = json(&["list", "--state", "unknown", "--scope", "acme"], 0);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["name"], "charge");
    assert_eq!(rows[0]["state"], "unknown");
    // Scripts get keys and scopes as the application passed them, and as stored.
    assert_eq!(
        (rows[0]["scope"].as_str(), rows[0]["key"].as_str()),
        (Some("acme"), Some("order-2"))
    );
    assert_eq!(
        (
            rows[0]["scope_encoded"].as_str(),
            rows[0]["key_encoded"].as_str()
        ),
        (Some("s4:acme"), Some("s7:order-2"))
    );
    let unknown_epoch = rows[0]["epoch"].as_u64().unwrap();
    let other_scope = json(&["list", "--scope", "globex"], 0);
    assert_eq!(other_scope, Value::Array(vec![]), "scope filter");

    // People get them as the application passed them.
    typed_keys(idem).await;
    let (listed, _) = text(&["list", "--name", "refund"], 0);
    for (shown_key, stored_key) in [
        ("42", "i42;"),
        (r#""42""#, "s2:42"),
        ("(acme, 7)", "t2(s4:acmei7;)"),
        (r#""two words""#, "s9:two words"),
    ] {
        // The last two columns: the name, then the key as passed.
        let line = listed
            .lines()
            .find(|l| {
                l.trim_end()
                    .strip_suffix(shown_key)
                    .is_some_and(|before| before.ends_with("refund  "))
            })
            .unwrap_or_else(|| panic!("no row ending in refund, {shown_key}:\n{listed}"));
        assert!(
            line.contains(" acme ") && !line.contains("s4:acme"),
            "{line}"
        );
        assert!(!line.contains(stored_key), "{line}");
    }
    let (encoded, _) = text(&["list", "--name", "refund", "--encoded"], 0);
    for stored_key in ["i42;", "s2:42", "t2(s4:acmei7;)", "s9:two words"] {
        line_with(&encoded, &["s4:acme", stored_key]);
    }
    // What `list` prints finds the record again: a quoted string, an integer.
    let quoted = json(&["show", "acme", "refund", r#""42""#], 0);
    assert_eq!(
        (&quoted["key"], &quoted["key_encoded"]),
        (&"\"42\"".into(), &"s2:42".into())
    );
    let int = json(&["show", "acme", "refund", "42", "--int-key"], 0);
    assert_eq!(
        (&int["key"], &int["key_encoded"]),
        (&"42".into(), &"i42;".into())
    );
    json(
        &["show", "s4:acme", "refund", "t2(s4:acmei7;)", "--encoded"],
        0,
    );

    let shown = json(&["show", "acme", "charge", "order-1"], 0);
    assert_eq!(shown["state"], "completed");
    assert_eq!(shown["outcome"]["body"], serde_json::json!({ "id": 1 }));
    assert!(shown["expires_in_ms"].as_u64().unwrap() > 0);
    let (card, _) = text(&["show", "acme", "charge", "order-1"], 0);
    assert_eq!(line_with(&card, &["scope"]), "scope      acme");
    assert_eq!(line_with(&card, &["key"]), "key        order-1");
    // Two largest units: a day's retention has 23h 59m left, not its seconds and millis.
    assert_eq!(
        line_with(&card, &["expires in"]),
        "expires in 23h 59m",
        "{card}"
    );
    let (card, _) = text(&["show", "s4:acme", "charge", "s7:order-1", "--encoded"], 0);
    assert_eq!(line_with(&card, &["key"]), "key        s7:order-1");
    // The key copied from `list --json` works with --encoded.
    let encoded = json(
        &[
            "show",
            rows[0]["scope_encoded"].as_str().unwrap(),
            "charge",
            rows[0]["key_encoded"].as_str().unwrap(),
            "--encoded",
        ],
        0,
    );
    assert_eq!(encoded["state"], "unknown");
    // An UNKNOWN operation lists the steps it completed; a completed one does not.
    let steps = encoded["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1, "{encoded}");
    assert_eq!(
        (steps[0]["label"].as_str(), steps[0]["value"].as_u64()),
        (Some("authorize"), Some(7))
    );
    assert_eq!(steps[0]["epoch"].as_u64(), Some(unknown_epoch));
    let (card, _) = text(&["show", "acme", "charge", "order-2"], 0);
    assert!(
        line_with(&card, &["steps"]).contains("1 completed"),
        "{card}"
    );
    let step: Vec<&str> = line_with(&card, &["authorize"])
        .split_whitespace()
        .collect();
    assert_eq!(
        step[..2],
        ["authorize", unknown_epoch.to_string().as_str()],
        "the step's label and epoch: {card}"
    );
    assert_eq!(
        json(&["show", "acme", "charge", "order-1"], 0)["steps"],
        serde_json::json!([])
    );

    // No such record: exit 3.
    json(&["show", "acme", "charge", "order-404"], 3);
    json(&["show", "acme", "charge", "1", "--int-key"], 3);

    // The operator checked the provider: the charge happened.
    let stale = (unknown_epoch + 1).to_string();
    let refused = json(
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
    // Not JSON (the shell ate the quotes): refused, saying what the value becomes.
    for not_json in ["not json", "ok", "{id: 9}"] {
        let (_, err) = text(
            &[
                "resolve",
                "acme",
                "charge",
                "order-2",
                "--completed",
                not_json,
            ],
            2,
        );
        assert!(
            err.contains("not valid JSON")
                && err.contains("replayed to every later caller as it is"),
            "{err}"
        );
    }
    let (done, _) = text(
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
    assert!(
        done.contains("every later call replays this outcome as it is: {\"id\":9}"),
        "{done}"
    );
    assert_eq!(
        charge(idem, "order-2", true).await,
        Ok(Receipt { id: 9 }),
        "the resolution replays, the body does not run"
    );
    // Resolving a completed record is refused.
    json(&["resolve", "acme", "charge", "order-2", "--retry"], 4);

    // The resolution was a mistake: forget it, fenced by the epoch read.
    let read = json(&["show", "acme", "charge", "order-2"], 0);
    let epoch = read["epoch"].as_u64().unwrap();
    let stale = (epoch + 1).to_string();
    let refused = json(
        &["forget", "acme", "charge", "order-2", "--epoch", &stale],
        4,
    );
    assert!(
        refused["error"].as_str().unwrap().contains("epoch"),
        "{refused}"
    );
    json(&["show", "acme", "charge", "order-2"], 0);
    let forgot = json(
        &[
            "forget",
            "acme",
            "charge",
            "order-2",
            "--epoch",
            &epoch.to_string(),
        ],
        0,
    );
    assert_eq!(forgot["forgotten"], true);
    assert_eq!(forgot["state"], "completed");
    json(&["show", "acme", "charge", "order-2"], 3);
    json(&["forget", "acme", "charge", "order-2"], 3);
    // The next call runs the body: the provider times out again, UNKNOWN again.
    assert_eq!(charge(idem, "order-2", true).await, Err(PayError::Timeout));
    let (forgot, _) = text(&["forget", "acme", "charge", "order-2"], 0);
    assert!(
        forgot.contains("forgot `charge` (scope acme, key order-2, unknown at epoch")
            && forgot.contains("the next call runs the body"),
        "{forgot}"
    );
    assert_eq!(charge(idem, "order-2", false).await, Ok(Receipt { id: 1 }));

    // A claim whose lease holds is never forgotten: its body may be running.
    let running = hanging_charge(idem, "order-4", Duration::from_secs(600)).await;
    let (_, err) = text(&["forget", "acme", "charge", "order-4"], 4);
    assert!(
        err.contains("lease holds") && err.contains("IN_PROGRESS"),
        "{err}"
    );
    assert_eq!(
        json(&["show", "acme", "charge", "order-4"], 0)["state"],
        "in_progress"
    );
    running.abort();

    // A stuck claim: the operator reads it, a claimant takes it over meanwhile, and the
    // operator's resolve at the epoch read is refused; the new claim stands.
    let stuck = hanging_charge(idem, "order-3", Duration::from_millis(300)).await;
    stuck.abort();
    let read = json(&["show", "acme", "charge", "order-3"], 0);
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
    let after = json(&["show", "acme", "charge", "order-3"], 0);
    assert_eq!(after["state"], "completed");
    assert_eq!(after["outcome"]["body"], serde_json::json!({ "id": 33 }));

    let purged = json(&["purge"], 0);
    assert_eq!(purged["purged"], 0, "nothing has expired");

    // People get tables.
    let (table, _) = text(&["stats"], 0);
    assert!(
        table.contains("completed") && table.contains("unknown"),
        "{table}"
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
    operator_flow(&sql_store(&url, "payments_idem"), &idem).await;

    // The default table does not exist in this file: a clear error, nothing created.
    let out = idem_cmd(&url, "idem_operations", &["stats"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("idem_operations") && err.contains("--table"),
        "{err}"
    );
}

/// An encrypted outcome is shown by its key id and size, never as its bytes.
#[tokio::test]
async fn an_encrypted_outcome_shows_its_key_and_size_only() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let keys = idem_runtime::Keyring::new("2026-03", [7u8; 32]).unwrap();
    let idem = Idem::builder()
        .encrypt(keys)
        .sqlite(&format!("{url}?mode=rwc"))
        .await
        .unwrap();
    let secret = "card ending 4242";
    idem.operation("charge", "order-1")
        .scope("acme")
        .retain(Duration::from_secs(3600))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(secret.to_owned()) })
        .await
        .unwrap();
    let shown = json(
        &url,
        "idem_operations",
        &["show", "acme", "charge", "order-1"],
        0,
    );
    let bytes = shown["outcome"]["encrypted"]["bytes"].as_u64().unwrap();
    assert_eq!(shown["outcome"]["encrypted"]["key_id"], "2026-03");
    assert_eq!(
        shown["outcome"]["body"],
        format!("encrypted (key 2026-03, {bytes} bytes)")
    );
    let (card, _) = text_on(
        &sql_store(&url, "idem_operations"),
        &["show", "acme", "charge", "order-1"],
        0,
    );
    let line = line_with(&card, &["outcome"]);
    assert_eq!(
        line,
        format!("outcome    encrypted (key 2026-03, {bytes} bytes)")
    );
    // Given the keyring, `show` opens it; a wrong keyring leaves it sealed.
    let opened = |keyring: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["--json", "--url", &url, "show", "acme", "charge", "order-1"])
            .args(["--keyring-env", "TEST_IDEM_KEYRING"])
            .env("TEST_IDEM_KEYRING", keyring)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let with = opened(&format!("2026-03:{}", "07".repeat(32)));
    assert_eq!(with["outcome"]["body"], secret);
    let wrong = opened(&format!("2026-04:{}", "08".repeat(32)));
    assert_eq!(wrong["outcome"]["encrypted"]["key_id"], "2026-03");
    let bad = self::idem(
        &sql_store(&url, "idem_operations"),
        &["stats", "--keyring-env", "TEST_IDEM_NOT_SET"],
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        !card.contains("4242") && !shown.to_string().contains("4242"),
        "{card}"
    );
}

#[tokio::test]
async fn every_subcommand_on_postgres() {
    let url = postgres_url();
    let table = format!("cli_{}", std::process::id());
    let opened = Idem::builder().table(&table).postgres(&url).await;
    let Some(idem) = reached_or_skip("every_subcommand_on_postgres", "PostgreSQL", &url, opened)
    else {
        return;
    };
    operator_flow(&sql_store(&url, &table), &idem).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(&format!(
        "DROP TABLE {table}_steps, {table}, {table}_meta CASCADE"
    ))
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
    let url = mysql_url();
    let table = format!("cli_{}", std::process::id());
    let opened = Idem::builder().table(&table).mysql(&url).await;
    let Some(idem) = reached_or_skip("every_subcommand_on_mysql", "MySQL", &url, opened) else {
        return;
    };
    operator_flow(&sql_store(&url, &table), &idem).await;
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    sqlx::query(&format!(
        "DROP TABLE `{table}_steps`, `{table}`, `{table}_meta`, `{table}_epoch_seq`"
    ))
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(&format!("DROP PROCEDURE IF EXISTS `{table}_claim`"))
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
    let out = idem_cmd("mongodb://x", "t", &["stats"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("expected sqlite://PATH") && err.contains("redis://"),
        "{err}"
    );

    // No store anywhere: say where one can be given.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("stats")
        .env_remove("IDEM_URL")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("IDEM_URL") && err.contains("DATABASE_URL"),
        "{err}"
    );

    // Cluster nodes must be Redis nodes.
    let out = idem(
        &[
            "--node".into(),
            "redis://127.0.0.1:1".into(),
            "--url".into(),
            "postgres://h/db".into(),
        ],
        &["stats"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node"));

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

/// `schema --table` renames every object in the DDL and leaves its comments as
/// shipped, which explain the default name.
#[test]
fn schema_prints_the_ddl_for_a_table() {
    for (dialect, needle, shipped) in [
        (
            "sqlite",
            "CREATE TABLE",
            idem_runtime::schema::SQLITE_SCHEMA_SQL,
        ),
        (
            "postgres",
            "CREATE TABLE",
            idem_runtime::schema::POSTGRES_SCHEMA_SQL,
        ),
        (
            "mysql",
            "ENGINE = InnoDB",
            idem_runtime::schema::MYSQL_SCHEMA_SQL,
        ),
    ] {
        let out = idem_cmd("unused://", "orders_idem", &["schema", dialect]);
        assert!(out.status.success());
        let sql = String::from_utf8_lossy(&out.stdout);
        assert!(sql.contains(needle) && sql.contains("orders_idem"), "{sql}");
        let code: Vec<&str> = sql.lines().map(|l| l.split("--").next().unwrap()).collect();
        assert!(
            !code.iter().any(|l| l.contains("idem_operations")),
            "renamed throughout: {sql}"
        );
        let comments = |text: &str| -> Vec<String> {
            let lines = text
                .lines()
                .filter_map(|l| l.find("--").map(|i| l[i..].to_owned()));
            lines
                .filter(|c| !c.starts_with("-- For the table"))
                .collect()
        };
        assert_eq!(comments(&sql), comments(shipped), "comments as shipped");
        assert!(
            sql.contains("idem renames `idem_operations`"),
            "the comment keeps its own name: {sql}"
        );
        // The default table: the DDL exactly as shipped, the procedure between
        // `DELIMITER` lines for the command-line client.
        let out = idem_cmd("unused://", "idem_operations", &["schema", dialect]);
        let printed = String::from_utf8_lossy(&out.stdout);
        let delimited = printed
            .replace("DELIMITER $$\n", "")
            .replace("END$$\nDELIMITER ;\n", "END;\n");
        assert_eq!(delimited, shipped);
        assert_eq!(printed.contains("DELIMITER $$\n"), dialect == "mysql");
    }
}

/// `idem schema mysql` piped into the `mysql` command-line client creates the table and
/// the claim's procedure, and the store then opens on them without migrating.
#[tokio::test]
async fn the_mysql_schema_runs_in_the_mysql_client() {
    let test = "the_mysql_schema_runs_in_the_mysql_client";
    let url = mysql_url();
    let required = db_required();
    // mysql://user[:password]@host[:port]/database
    let rest = url.strip_prefix("mysql://").expect("a mysql:// URL");
    let (user, rest) = rest.split_once('@').expect("a user in the URL");
    let (user, password) = user.split_once(':').unwrap_or((user, ""));
    let (host, database) = rest.split_once('/').expect("a database in the URL");
    let (host, port) = host.split_once(':').unwrap_or((host, "3306"));
    let mut client = std::process::Command::new("mysql");
    client.args(["-h", host, "-P", port, "-u", user, database]);
    if !password.is_empty() {
        client.arg(format!("-p{password}"));
    }
    let table = format!("cli_piped_{}", std::process::id());
    let ddl = idem_cmd("unused://", &table, &["schema", "mysql"]);
    assert!(ddl.status.success());
    let mut child = match client
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) if required => panic!("the mysql client is required (IDEM_REQUIRE_DB=1): {e}"),
        Err(e) => {
            skip(test, &format!("no mysql client ({e})"));
            return;
        }
    };
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&ddl.stdout).unwrap();
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    if !done.status.success() && !required && err.contains("Can't connect") {
        skip(test, &format!("MySQL not reachable at {url} ({err})"));
        return;
    }
    assert!(done.status.success(), "{err}");
    let outcome = async {
        let idem = Idem::builder()
            .table(&table)
            .migrate(false)
            .mysql(&url)
            .await?;
        let mut answers = Vec::new();
        for _ in 0..2 {
            let n = idem
                .operation("piped", "k")
                .retain(std::time::Duration::from_secs(60))
                .fingerprint_none()
                .run(|| async { Ok::<_, idem_runtime::IdemError>(7) })
                .await?;
            answers.push(n);
        }
        Ok::<_, idem_runtime::IdemError>(answers)
    }
    .await;
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    for drop in [
        format!("DROP TABLE `{table}_steps`, `{table}`, `{table}_meta`, `{table}_epoch_seq`"),
        format!("DROP PROCEDURE `{table}_claim`"),
    ] {
        sqlx::query(&drop).execute(&pool).await.unwrap();
    }
    assert_eq!(outcome.expect("the store runs on the piped schema"), [7, 7]);
}

/// `completions` prints a script for each shell, with no store needed.
#[test]
fn completions_for_bash_zsh_and_fish() {
    for (shell, marker) in [
        ("bash", "_idem()"),
        ("zsh", "#compdef idem"),
        ("fish", "complete -c idem"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["completions", shell])
            .env_remove("IDEM_URL")
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{shell}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let script = String::from_utf8_lossy(&out.stdout);
        for needle in [marker, "forget", "resolve", "key-prefix"] {
            assert!(script.contains(needle), "{shell}: no {needle:?}");
        }
    }
    let out = idem_cmd("unused://", "t", &["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
}

/// The store comes from `--url`, else `IDEM_URL`, else `DATABASE_URL`; `--help` names
/// both variables and shows neither value.
#[tokio::test]
async fn the_url_falls_back_to_idem_url_then_database_url() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let idem = Idem::sqlite(&format!("{url}?mode=rwc")).await.unwrap();
    charge(&idem, "order-1", false).await.unwrap();
    let missing = format!("sqlite://{}", dir.path().join("missing.db").display());
    let run = |args: &[&str], idem_url: Option<&str>, database_url: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(args)
            .env_remove("IDEM_URL")
            .env_remove("DATABASE_URL");
        if let Some(v) = idem_url {
            cmd.env("IDEM_URL", v);
        }
        if let Some(v) = database_url {
            cmd.env("DATABASE_URL", v);
        }
        cmd.output().unwrap()
    };
    let completed = |out: &Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stats: Value = serde_json::from_slice(&out.stdout).unwrap();
        stats["completed"].as_u64()
    };
    assert_eq!(
        completed(&run(&["--json", "stats"], None, Some(&url))),
        Some(1)
    );
    assert_eq!(
        completed(&run(&["--json", "stats"], Some(&url), Some(&missing))),
        Some(1)
    );
    assert_eq!(
        completed(&run(
            &["--json", "--url", &url, "stats"],
            Some(&missing),
            Some(&missing)
        )),
        Some(1)
    );
    // IDEM_URL comes before DATABASE_URL.
    let out = run(&["stats"], Some(&missing), Some(&url));
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.db"));

    let secret = "postgres://u:hunter2@127.0.0.1/db";
    for args in [&["--help"][..], &["stats", "--help"]] {
        let out = run(args, Some(secret), Some(secret));
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("IDEM_URL") && help.contains("DATABASE_URL"),
            "{help}"
        );
        assert_no_secret("--help", &help);
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
        "mongodb://:hunter2@127.0.0.1:27017",
        "http://u:hunter2@h/x?password=hunter2",
        "u:hunter2@db/app",
    ] {
        let out = idem_cmd(url, "t", &["stats"]);
        assert_eq!(out.status.code(), Some(2), "{url}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("unsupported store URL"), "{err}");
        assert_no_secret(url, &err);
    }
    let out = idem_cmd("mongodb://:hunter2@h", "t", &["stats"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("`mongodb://`"));

    // Nothing listens on port 1: the connect error quotes the URL, redacted.
    for url in [
        "postgres://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
        "postgres://u:pa?ss@127.0.0.1:1/db",
        "mysql://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
        "redis://:hunter2@127.0.0.1:1",
        "redis://u:s3cr@127.0.0.1:1/0",
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
    // Shown as the application passed them, quoted (they hold spaces and control
    // characters), the control characters escaped.
    assert!(
        text.contains(r#""k\u{1b}[2J\rorder-1 completed""#)
            && text.contains(r#""acme\u{7}\u{202e}""#),
        "{text}"
    );
    let out = idem_cmd(&url, table, &["list", "--encoded"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!has_control(&out.stdout), "{text}");
    assert!(
        text.contains(r"s23:k\u{1b}[2J\rorder-1 completed"),
        "{text}"
    );
    let rows = json(&url, table, &["list"], 0);
    assert_eq!(rows[0]["key_encoded"], format!("s{}:{key}", key.len()));
    // Decoded, exactly: quoted (it holds spaces), control characters kept for JSON.
    assert_eq!(rows[0]["key"], format!("\"{key}\""));
}

/// The operator flow on Redis, by `redis://` URL and key prefix; a prefix no application
/// opened is an error (and is left unwritten), and keys stored hashed need the secret.
#[tokio::test]
async fn every_subcommand_on_redis() {
    let url = redis_url();
    let prefix = unique_prefix("flow");
    let opened = Idem::builder().key_prefix(&prefix).redis(&url).await;
    let Some(idem) = reached_or_skip("every_subcommand_on_redis", "Redis", &url, opened) else {
        return;
    };
    let store: Vec<String> = ["--url", &url, "--key-prefix", &prefix]
        .map(String::from)
        .to_vec();
    operator_flow(&store, &idem).await;
    delete_redis_prefix(&url, &prefix).await;

    let nobody = unique_prefix("nobody");
    let (_, err) = text_on(
        &["--url", &url, "--key-prefix", &nobody].map(String::from),
        &["stats"],
        1,
    );
    assert!(
        err.contains(&format!(
            "no idem store under the Redis key prefix `{nobody}`"
        )) && err.contains("--key-prefix"),
        "{err}"
    );
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let written: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{nobody}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        written,
        Vec::<String>::new(),
        "idem wrote to a prefix it only read"
    );

    let hashed = unique_prefix("hashed");
    let secret = "0123456789abcdef0123456789abcdef";
    let app = Idem::builder()
        .key_prefix(&hashed)
        .hash_keys(secret)
        .redis(&url)
        .await
        .unwrap();
    charge(&app, "order-1", false).await.unwrap();
    let run = |with_secret: bool, args: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(["--url", &url, "--key-prefix", &hashed])
            .env_remove("IDEM_URL")
            .env_remove("DATABASE_URL");
        if with_secret {
            cmd.args(["--secret-env", "CLI_TEST_SECRET"])
                .env("CLI_TEST_SECRET", secret);
        }
        cmd.args(args).output().unwrap()
    };
    let out = run(false, &["stats"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--secret-env"));
    let out = run(true, &["--json", "show", "acme", "charge", "order-1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["state"], "completed");
    let out = run(true, &["list"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(" h:") && !text.contains("order-1"), "{text}");
    delete_redis_prefix(&url, &hashed).await;
}

/// The operator flow on a Redis Cluster reached by repeated `--node`; a comma-separated
/// `--url` of the nodes reaches the same records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_on_a_redis_cluster() {
    let Some(cluster) = RedisCluster::start("every_subcommand_on_a_redis_cluster").await else {
        return;
    };
    let urls = cluster.urls();
    let nodes: Vec<&str> = urls.iter().map(String::as_str).collect();
    let idem = Idem::builder()
        .key_prefix("billing")
        .redis_cluster(&nodes)
        .await
        .unwrap();
    let mut store = Vec::new();
    for url in &urls {
        store.extend(["--node".to_owned(), url.clone()]);
    }
    store.extend(["--key-prefix".to_owned(), "billing".to_owned()]);
    operator_flow(&store, &idem).await;

    let by_url = [
        "--url".to_owned(),
        urls.join(","),
        "--key-prefix".to_owned(),
        "billing".to_owned(),
    ];
    let counts = |stats: Value| {
        let n = |state: &str| stats[state].as_u64().unwrap();
        (n("completed"), n("in_progress"), n("unknown"))
    };
    let by_nodes = counts(json_on(&store, &["stats"], 0));
    assert_eq!(counts(json_on(&by_url, &["stats"], 0)), by_nodes);
    assert!(by_nodes.0 >= 4, "{by_nodes:?}");
}

/// A key of the application's own encoding, as a `KeyPart` it implements itself.
struct OwnKey(&'static str);

impl idem_runtime::KeyPart for OwnKey {
    fn write_key(&self, out: &mut String) {
        out.push_str(self.0);
    }
}

/// Any stored key lists and shows, whatever character it starts with: a key of the
/// application's own encoding is shown as stored.
#[tokio::test]
async fn keys_of_the_applications_own_encoding_list_and_show() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let idem = Idem::sqlite(&format!("{url}?mode=rwc")).await.unwrap();
    for key in ["é-7", "日本:1", "€"] {
        idem.operation("sku", &OwnKey(key))
            .retain(Duration::from_secs(3600))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(()) })
            .await
            .unwrap();
    }
    let table = "idem_operations";
    let (listed, _) = text_on(&sql_store(&url, table), &["list"], 0);
    for key in ["é-7", "日本:1", "€"] {
        line_with(&listed, &["sku", key]);
    }
    let rows = json(&url, table, &["list"], 0);
    assert_eq!(rows.as_array().unwrap().len(), 3, "{rows}");
    let shown = json(&url, table, &["show", "", "sku", "é-7", "--encoded"], 0);
    assert_eq!(
        (&shown["key"], &shown["state"]),
        (&"é-7".into(), &"completed".into())
    );
}

/// `list --newer-than` keeps the last records, `--newest-first` turns the order round.
#[tokio::test]
async fn list_the_newest_records_first() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("app.db").display());
    let idem = Idem::sqlite(&format!("{url}?mode=rwc")).await.unwrap();
    for order in ["order-1", "order-2", "order-3"] {
        charge(&idem, order, false).await.unwrap();
        // Claim times a few milliseconds apart, so the order is the claims' order.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let table = "idem_operations";
    let keys = |rows: Value| -> Vec<String> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| r["key"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        keys(json(&url, table, &["list"], 0)),
        ["order-1", "order-2", "order-3"]
    );
    assert_eq!(
        keys(json(
            &url,
            table,
            &["list", "--newest-first", "--limit", "2"],
            0
        )),
        ["order-3", "order-2"]
    );
    assert_eq!(
        keys(json(
            &url,
            table,
            &["list", "--newer-than", "1h", "--newest-first"],
            0
        )),
        ["order-3", "order-2", "order-1"]
    );
    // Each record is at least a few milliseconds old by now.
    let none = json(&url, table, &["list", "--newer-than", "1ms"], 0);
    assert_eq!(none, Value::Array(vec![]));
}
