//! The queue consumer example against the real JetStream server: each business
//! message has one effect whatever the broker and the producer repeat, through a
//! SIGKILL, an in-flight duplicate, a reused id and a transient failure.
//!
//! Every test uses its own stream, consumer and SQLite file, and deletes its stream.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::queue::{Action, AsIdemError, Cause, Policy, Verdict};
use idem_runtime::{Disposition, Idem, IdemError};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// The example's payload, field for field: the in-flight test claims with the same
/// fingerprint the consumer computes.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PaymentRequested {
    payment_id: String,
    amount_cents: i64,
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects to JetStream, or says why the test is skipped (a failure under
/// `IDEM_REQUIRE_DB=1`).
async fn jetstream() -> Option<jetstream::Context> {
    match async_nats::connect(nats_url()).await {
        Ok(client) => Some(jetstream::new(client)),
        Err(e) if std::env::var("IDEM_REQUIRE_DB").is_ok_and(|v| v == "1") => {
            panic!(
                "NATS is required (IDEM_REQUIRE_DB=1) but {} is not reachable: {e}",
                nats_url()
            )
        }
        Err(e) => {
            eprintln!(
                "skipping: NATS JetStream not reachable at {} ({e})",
                nats_url()
            );
            None
        }
    }
}

/// The example binary, built once per test run (cargo runs this test without
/// necessarily building examples first).
fn consumer_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args(["build", "-q", "--workspace", "--example", "queue_consumer"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build");
        assert!(
            status.success(),
            "cargo build --example queue_consumer failed"
        );
        // target/<profile>/deps/<this test> → target/<profile>/examples/queue_consumer
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap();
        profile_dir.join("examples").join("queue_consumer")
    })
}

/// One test's stream, consumer and database.
struct Setup {
    js: jetstream::Context,
    stream: String,
    subject: String,
    consumer: String,
    db: PathBuf,
    _dir: tempfile::TempDir,
}

impl Setup {
    async fn new(test: &str) -> Option<Setup> {
        let js = jetstream().await?;
        let unique = format!(
            "{}_{}_{}",
            test.to_uppercase(),
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let stream = format!("IDEM_{unique}");
        let subject = format!("idem.{unique}.payments");
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        Some(Setup {
            js,
            consumer: format!("C_{unique}"),
            db: dir.path().join("queue_consumer.db"),
            stream,
            subject,
            _dir: dir,
        })
    }

    /// Publishes without `Nats-Msg-Id`: JetStream keeps every copy.
    async fn publish(&self, payment_id: &str, amount_cents: i64) {
        let msg = PaymentRequested {
            payment_id: payment_id.into(),
            amount_cents,
        };
        self.js
            .publish(
                self.subject.clone(),
                serde_json::to_vec(&msg).unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    fn spawn(&self, ack_wait: u64, idle: u64, env: &[(&str, &str)]) -> Consumer {
        let mut cmd = Command::new(consumer_binary());
        cmd.args(["--stream", &self.stream, "--subject", &self.subject])
            .args(["--consumer", &self.consumer])
            .args(["--ack-wait", &ack_wait.to_string()])
            .args(["--exit-when-idle", &idle.to_string()])
            .env("IDEM_NATS_URL", nats_url())
            .env("IDEM_EXAMPLE_DB", &self.db)
            .env_remove("IDEM_POSTGRES_URL")
            .env_remove("QUEUE_CONSUMER_FLAKY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start the queue consumer example");
        let (tx, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let out = tx.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let _ = out.send(line);
            }
        });
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                eprintln!("consumer: {line}");
                let _ = tx.send(format!("stderr {line}"));
            }
        });
        Consumer { child, lines }
    }

    /// Consumes until the consumer has nothing left: runs it again while messages are
    /// pending or unacknowledged (a redelivery may come after an idle exit).
    async fn drain(&self, ack_wait: u64, env: &[(&str, &str)]) -> Vec<String> {
        let mut seen = Vec::new();
        for _ in 0..10 {
            let mut consumer = self.spawn(ack_wait, ack_wait + 3, env);
            seen.extend(consumer.finish().await);
            let (pending, unacked) = self.pending().await;
            if pending == 0 && unacked == 0 {
                return seen;
            }
        }
        panic!("messages still pending after 10 consumer runs");
    }

    async fn pending(&self) -> (u64, usize) {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let mut consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(&self.consumer).await.unwrap();
        let info = consumer.info().await.unwrap();
        (info.num_pending, info.num_ack_pending)
    }

    async fn payments(&self) -> (i64, i64) {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", self.db.display()))
            .await
            .unwrap();
        sqlx::query_as("SELECT count(*), count(DISTINCT payment_id) FROM payments")
            .fetch_one(&pool)
            .await
            .unwrap()
    }

    async fn delete(self) {
        self.js.delete_stream(&self.stream).await.unwrap();
    }
}

struct Consumer {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Consumer {
    /// Reads output until a line contains every one of `parts`; returns the lines read.
    async fn until(&mut self, parts: &[&str]) -> Vec<String> {
        let mut seen = Vec::new();
        while let Some(line) = self.lines.recv().await {
            let hit = parts.iter().all(|p| line.contains(p));
            seen.push(line);
            if hit {
                return seen;
            }
        }
        panic!("the consumer exited before printing {parts:?}; it printed:\n{seen:#?}");
    }

    /// Waits for the consumer to exit on its own; returns the rest of its output.
    async fn finish(&mut self) -> Vec<String> {
        let status = self.child.wait().await.unwrap();
        assert!(status.success(), "the consumer failed: {status}");
        let mut seen = Vec::new();
        while let Some(line) = self.lines.recv().await {
            seen.push(line);
        }
        seen
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_payments_once_through_duplicates_and_a_kill() {
    let Some(setup) = Setup::new("kill").await else {
        return;
    };
    for i in 1..=500 {
        setup.publish(&format!("p-{i}"), 100 * i).await;
        // One in ten republished by the producer: a new sequence number, no msg id.
        if i % 10 == 0 {
            setup.publish(&format!("p-{i}"), 100 * i).await;
        }
    }

    let mut first = setup.spawn(2, 30, &[]);
    // Killed mid-run: some message is between its claim, its commit and its ack.
    for _ in 0..150 {
        first.until(&["verdict"]).await;
    }
    first.child.start_kill().unwrap();
    let status = first.child.wait().await.unwrap();
    assert!(!status.success(), "the consumer should have been killed");

    let seen = setup.drain(2, &[]).await;
    assert!(
        seen.iter().any(|l| l.contains("cause=Replayed")),
        "the republished and redelivered messages replay"
    );
    assert_eq!(setup.payments().await, (500, 500), "one effect per payment");
    assert_eq!(setup.pending().await, (0, 0), "every message acked");
    setup.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_elsewhere_is_redelivered_then_acked_as_a_replay() {
    let Some(setup) = Setup::new("inflight").await else {
        return;
    };
    // Another worker (this test) holds the claim for p-1 while the consumer sees it.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}?mode=rwc", setup.db.display()))
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (payment_id TEXT NOT NULL, \
         amount_cents INTEGER NOT NULL, applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let idem = Idem::from_pool(pool.clone()).await.unwrap();
    let msg = PaymentRequested {
        payment_id: "p-1".into(),
        amount_cents: 100,
    };
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (release_tx, release) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let (idem, pool, msg) = (idem.clone(), pool.clone(), msg.clone());
        tokio::spawn(async move {
            idem.operation("apply_payment", &msg.payment_id)
                .fingerprint(&&msg)
                .lease(Duration::from_secs(3))
                .retain(std::time::Duration::from_secs(86_400))
                .run(|| async {
                    started_tx.send(()).unwrap();
                    release.await.unwrap();
                    sqlx::query("INSERT INTO payments (payment_id, amount_cents) VALUES (?1, ?2)")
                        .bind(&msg.payment_id)
                        .bind(msg.amount_cents)
                        .execute(&pool)
                        .await
                        .unwrap();
                    Ok::<_, IdemError>(msg.clone())
                })
                .await
        })
    };
    started.await.unwrap();
    setup.publish("p-1", 100).await;

    let mut consumer = setup.spawn(30, 10, &[]);
    consumer
        .until(&[
            "payment_id=p-1",
            "delivery=1",
            "cause=InFlight",
            "action=Redeliver",
        ])
        .await;
    release_tx.send(()).unwrap();
    holder.await.unwrap().unwrap();
    consumer
        .until(&[
            "payment_id=p-1",
            "delivery=2",
            "cause=Replayed",
            "action=Ack",
        ])
        .await;
    consumer.finish().await;

    assert_eq!(setup.payments().await, (1, 1), "the holder's effect only");
    assert_eq!(setup.pending().await, (0, 0));
    setup.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_payment_id_is_terminated_with_an_alert_and_no_effect() {
    let Some(setup) = Setup::new("mismatch").await else {
        return;
    };
    setup.publish("p-1", 100).await;
    setup.publish("p-1", 999).await;
    let seen = setup.drain(5, &[]).await;
    assert!(
        seen.iter()
            .any(|l| l.contains("payment_id=p-1 delivery=1 cause=Done action=Ack"))
    );
    assert!(
        seen.iter()
            .any(|l| l.contains("payment_id=p-1") && l.contains("cause=Mismatch action=Terminate")),
        "{seen:#?}"
    );
    assert!(
        seen.iter()
            .any(|l| l.starts_with("stderr") && l.contains("message needs attention")),
        "the alert event: {seen:#?}"
    );
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", setup.db.display()))
        .await
        .unwrap();
    let amounts: Vec<i64> = sqlx::query_scalar("SELECT amount_cents FROM payments")
        .fetch_all(&pool)
        .await
        .unwrap();
    // A pulled batch runs its messages at once, so either may be the one applied.
    assert!(
        amounts == [100] || amounts == [999],
        "one payment applied, the other never: {amounts:?}"
    );
    assert_eq!(setup.pending().await, (0, 0), "terminated, not redelivered");
    setup.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_error_is_redelivered_and_then_succeeds() {
    let Some(setup) = Setup::new("released").await else {
        return;
    };
    for i in 1..=3 {
        setup.publish(&format!("p-{i}"), 100 * i).await;
    }
    let seen = setup.drain(5, &[("QUEUE_CONSUMER_FLAKY", "p-2")]).await;
    assert!(
        seen.iter()
            .any(|l| l.contains("payment_id=p-2 delivery=1 cause=Released action=Redeliver")),
        "{seen:#?}"
    );
    // A consumer that went idle before the redelivery is run again, and its process
    // fails p-2 once more: the success may come on a later delivery than the second.
    assert!(
        seen.iter().any(|l| l.contains("payment_id=p-2 delivery=")
            && l.contains("cause=Done action=Ack")
            && !l.contains("delivery=1 ")),
        "{seen:#?}"
    );
    assert_eq!(setup.payments().await, (3, 3));
    assert_eq!(setup.pending().await, (0, 0));
    setup.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_payment_id_is_terminated_as_invalid_with_an_alert() {
    let Some(setup) = Setup::new("emptykey").await else {
        return;
    };
    // A producer that lost the id: keyed on "", every such message would be one payment.
    setup.publish("", 100).await;
    setup.publish("p-1", 200).await;
    let seen = setup.drain(5, &[]).await;
    assert!(
        seen.iter()
            .any(|l| l.contains("payment_id= delivery=1 cause=Invalid action=Terminate")),
        "{seen:#?}"
    );
    assert!(
        seen.iter()
            .any(|l| l.starts_with("stderr") && l.contains("message needs attention")),
        "the alert event: {seen:#?}"
    );
    assert_eq!(setup.payments().await, (1, 1), "p-1 only");
    assert_eq!(setup.pending().await, (0, 0), "terminated, not redelivered");
    setup.delete().await;
}

/// Everything `Policy::run` logged, for the alert it raises.
struct Logged(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `handler` through the default policy, returning its verdict and the events logged.
async fn verdict_of<F, T, E>(handler: F, delivery: u64) -> (Verdict, String)
where
    F: std::future::Future<Output = Result<T, E>>,
    E: AsIdemError + std::fmt::Display,
{
    let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || Logged(sink.clone()))
        .finish();
    // A current-thread runtime: the policy logs on this thread.
    let _guard = tracing::subscriber::set_default(subscriber);
    let (_, verdict) = Policy::default().run(handler, delivery).await;
    let logged = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    (verdict, logged)
}

#[derive(Debug, thiserror::Error)]
enum ApplyError {
    #[error("the ledger timed out; the payment may have been applied")]
    Timeout,
    #[error(transparent)]
    Idem(#[from] IdemError),
}

impl AsIdemError for ApplyError {
    fn as_idem_error(&self) -> Option<&IdemError> {
        match self {
            ApplyError::Idem(e) => Some(e),
            ApplyError::Timeout => None,
        }
    }
}

impl Serialize for ApplyError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ApplyError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(|_| ApplyError::Timeout)
    }
}

/// A handler error classified `Unknown` parks the operation in UNKNOWN: the message is
/// terminated with an alert, not redelivered as if released, and so is its redelivery.
#[tokio::test]
async fn a_handler_error_classified_unknown_terminates_with_an_alert() {
    let idem = Idem::memory();
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let apply = || {
        idem.operation("apply_payment", "p-1")
            .retain(Duration::from_secs(86_400))
            .fingerprint(&100i64)
            .classify(|e: &ApplyError| match e {
                ApplyError::Timeout => Disposition::Unknown,
                ApplyError::Idem(_) => Disposition::Release,
            })
            .run(|| async {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Err::<i64, _>(ApplyError::Timeout)
            })
    };
    for delivery in [1, 2] {
        let (verdict, logged) = verdict_of(apply(), delivery).await;
        assert_eq!(
            (verdict.action, verdict.cause),
            (Action::Terminate, Cause::Unknown),
            "delivery {delivery}"
        );
        assert!(verdict.alert(), "delivery {delivery}");
        assert!(
            logged.contains("ERROR") && logged.contains("message needs attention"),
            "delivery {delivery}: no alert event in {logged:?}"
        );
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An outcome that does not serialize cannot be recorded; the handler ran, so the
/// operation is UNKNOWN: `Unknown`, not `Invalid`.
#[tokio::test]
async fn an_outcome_that_does_not_serialize_terminates_as_unknown() {
    let idem = Idem::memory();
    let apply = || {
        idem.operation("apply_payment", "p-2")
            .retain(Duration::from_secs(86_400))
            .fingerprint(&100i64)
            .run(|| async {
                // JSON object keys must be strings: serde_json refuses this map.
                let applied: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
                Ok::<_, IdemError>(applied)
            })
    };
    for delivery in [1, 2] {
        let (verdict, logged) = verdict_of(apply(), delivery).await;
        assert_eq!(
            (verdict.action, verdict.cause),
            (Action::Terminate, Cause::Unknown),
            "delivery {delivery}"
        );
        assert!(logged.contains("message needs attention"), "{logged:?}");
    }
}

/// Applies a payment in the caller's transaction and answers with a report of
/// `report_bytes` bytes.
#[idem_runtime::idempotent(store = idem, tx = tx, key = payment_id, retain = "1d")]
async fn apply_with_report(
    idem: &Idem,
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    payment_id: &str,
    report_bytes: usize,
    #[idem(skip)] runs: &std::sync::atomic::AtomicUsize,
) -> Result<String, IdemError> {
    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    sqlx::query("INSERT INTO ledger (payment_id) VALUES (?1)")
        .bind(payment_id)
        .execute(&mut **tx)
        .await
        .unwrap();
    Ok("r".repeat(report_bytes))
}

/// A transactional handler whose outcome is over the cap applied nothing: its ledger
/// row was rolled back with its claim. The message is redelivered as released (not
/// terminated as UNKNOWN), and its redelivery runs the handler again; once the outcome
/// fits, it is applied once.
#[tokio::test]
async fn a_transactional_outcome_over_the_cap_is_released_with_nothing_applied() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("ledger.db").display()
    );
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE ledger (payment_id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let idem = Idem::builder()
        .max_outcome_bytes(64)
        .pool(pool.clone())
        .await
        .unwrap();
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let deliver = |report_bytes: usize| {
        let (pool, idem, runs) = (&pool, &idem, &runs);
        async move {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
            let out = apply_with_report(idem, &mut tx, "p-9", report_bytes, runs).await;
            tx.commit().await.unwrap();
            out
        }
    };
    let applied = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(&pool)
            .await
            .unwrap();
        n
    };
    for delivery in [1, 2] {
        let (verdict, _) = verdict_of(deliver(1000), delivery).await;
        assert!(
            matches!(
                (verdict.action, verdict.cause),
                (Action::Redeliver { .. }, Cause::Released)
            ),
            "delivery {delivery}: {verdict:?}"
        );
        assert_eq!(applied().await, 0, "delivery {delivery}: rolled back");
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    let (verdict, _) = verdict_of(deliver(10), 3).await;
    assert_eq!((verdict.action, verdict.cause), (Action::Ack, Cause::Done));
    let (verdict, _) = verdict_of(deliver(10), 4).await;
    assert_eq!(
        (verdict.action, verdict.cause),
        (Action::Ack, Cause::Replayed)
    );
    assert_eq!(applied().await, 1);
}

#[derive(Debug, thiserror::Error)]
enum LedgerError {
    #[error("the ledger is busy")]
    Busy,
    #[error(transparent)]
    Idem(#[from] IdemError),
}

impl AsIdemError for LedgerError {
    fn as_idem_error(&self) -> Option<&IdemError> {
        match self {
            LedgerError::Idem(e) => Some(e),
            LedgerError::Busy => None,
        }
    }
}

/// A JetStream message with its decoded payment.
type Pulled = (jetstream::Message, PaymentRequested);

/// Pulls at least `n` messages (more if they come together) from `consumer`.
async fn pull(consumer: &jetstream::consumer::PullConsumer, n: usize) -> Vec<Pulled> {
    use futures_util::StreamExt;
    let mut pulled = Vec::new();
    for _ in 0..30 {
        let mut batch = consumer
            .batch()
            .max_messages(n.max(1))
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .unwrap();
        while let Some(message) = batch.next().await {
            let message = message.unwrap();
            let request = serde_json::from_slice(&message.payload).unwrap();
            pulled.push((message, request));
        }
        if pulled.len() >= n {
            return pulled;
        }
    }
    panic!("JetStream delivered {} of {n} messages", pulled.len());
}

/// One batch pulled from JetStream holds a good payment, one whose ledger call fails
/// (released), one that reuses an applied payment id with another amount, and one whose
/// handler panics mid-body: `Policy::run_batch` answers ack, redeliver, terminate and
/// redeliver, each as it would alone. The redeliveries then succeed; every payment's
/// effect happens once, and nothing is left pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pulled_batch_answers_each_message_on_its_own() {
    use async_nats::jetstream::AckKind;
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    let Some(setup) = Setup::new("batch").await else {
        return;
    };
    let idem = Idem::memory();
    let effects: Arc<Mutex<BTreeMap<String, Vec<i64>>>> = Arc::default();
    let apply = |request: &PaymentRequested, delivery: u64| {
        let (idem, effects, request) = (idem.clone(), effects.clone(), request.clone());
        async move {
            idem.operation("apply_payment", &request.payment_id)
                .fingerprint(&request)
                .lease(Duration::from_millis(500))
                .retain(Duration::from_secs(86_400))
                .run(|| async {
                    match (request.payment_id.as_str(), delivery) {
                        ("p-2", 1) => return Err(LedgerError::Busy),
                        ("p-4", 1) => panic!("a bug in the handler"),
                        _ => {}
                    }
                    let mut effects = effects.lock().unwrap();
                    let applied = effects.entry(request.payment_id.clone()).or_default();
                    applied.push(request.amount_cents);
                    Ok::<_, LedgerError>(request.amount_cents)
                })
                .await
        }
    };
    // p-3 was applied with 300 before; its message now says 999.
    let earlier = PaymentRequested {
        payment_id: "p-3".into(),
        amount_cents: 300,
    };
    apply(&earlier, 1).await.unwrap();
    for (id, amount) in [("p-1", 100), ("p-2", 200), ("p-3", 999), ("p-4", 400)] {
        setup.publish(id, amount).await;
    }
    let stream = setup.js.get_stream(&setup.stream).await.unwrap();
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(setup.consumer.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .unwrap();

    let delivery = |(message, _): &Pulled| message.info().unwrap().delivered as u64;
    let policy = Policy::default();
    let mut outstanding: Vec<String> = Vec::new();
    let mut first = true;
    let mut rounds = 0;
    while first || !outstanding.is_empty() {
        rounds += 1;
        assert!(rounds < 50, "still redelivering {outstanding:?}");
        let batch = pull(&consumer, if first { 4 } else { 1 }).await;
        let handled = policy
            .run_batch(&batch, delivery, |item| apply(&item.1, delivery(item)))
            .await;
        let verdicts: BTreeMap<String, (Cause, Action)> = batch
            .iter()
            .zip(&handled)
            .map(|((_, r), h)| (r.payment_id.clone(), (h.verdict.cause, h.verdict.action)))
            .collect();
        if first {
            let causes: Vec<(&str, Cause)> =
                verdicts.iter().map(|(id, v)| (id.as_str(), v.0)).collect();
            assert_eq!(
                causes,
                [
                    ("p-1", Cause::Done),
                    ("p-2", Cause::Released),
                    ("p-3", Cause::Mismatch),
                    ("p-4", Cause::Panicked),
                ]
            );
            assert_eq!(verdicts["p-1"].1, Action::Ack);
            assert!(matches!(verdicts["p-2"].1, Action::Redeliver { .. }));
            assert_eq!(verdicts["p-3"].1, Action::Terminate);
            assert!(matches!(verdicts["p-4"].1, Action::Redeliver { .. }));
            let p4 = batch.iter().position(|(_, r)| r.payment_id == "p-4");
            let panicked = &handled[p4.unwrap()];
            assert!(panicked.verdict.alert() && panicked.result.is_none());
        }
        for ((message, request), handled) in batch.iter().zip(handled) {
            outstanding.retain(|id| id != &request.payment_id);
            match handled.verdict.action {
                Action::Ack => message.double_ack().await.unwrap(),
                Action::Redeliver { after } => {
                    outstanding.push(request.payment_id.clone());
                    message.ack_with(AckKind::Nak(Some(after))).await.unwrap()
                }
                Action::Terminate => message.ack_with(AckKind::Term).await.unwrap(),
            }
        }
        first = false;
    }

    let effects = effects.lock().unwrap().clone();
    let expected: BTreeMap<String, Vec<i64>> = [
        ("p-1", vec![100]),
        ("p-2", vec![200]),
        ("p-3", vec![300]),
        ("p-4", vec![400]),
    ]
    .into_iter()
    .map(|(id, amounts)| (id.to_owned(), amounts))
    .collect();
    assert_eq!(
        effects, expected,
        "one effect per payment, the first amount"
    );
    assert_eq!(
        setup.pending().await,
        (0, 0),
        "every message acked or terminated"
    );
    setup.delete().await;
}
