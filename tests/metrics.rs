//! The counters and the body-duration histogram, read back from a real recorder.

use std::time::Duration;

use idem_runtime::metrics as m;
use idem_runtime::{Disposition, Idem, IdemError, InFlight};
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::collections::HashMap;
use std::sync::Mutex;

fn recorder() -> &'static Snapshotter {
    static SNAP: std::sync::OnceLock<Snapshotter> = std::sync::OnceLock::new();
    SNAP.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    })
}

/// Everything recorded so far: the snapshotter hands out counter increments and
/// histogram samples once, so they are accumulated here.
fn total(metric: &str, op: &str) -> u64 {
    static TOTALS: Mutex<Option<HashMap<(String, String), u64>>> = Mutex::new(None);
    let mut guard = TOTALS.lock().unwrap();
    let totals = guard.get_or_insert_with(HashMap::new);
    for (key, _, _, value) in recorder().snapshot().into_vec() {
        let name = key
            .key()
            .labels()
            .find(|l| l.key() == "name")
            .map_or(String::new(), |l| l.value().to_owned());
        let n = match (key.kind(), value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => n,
            (MetricKind::Histogram, DebugValue::Histogram(samples)) => {
                let sum: f64 = samples.iter().map(|s| s.into_inner()).sum();
                *totals
                    .entry((format!("{}:sum", key.key().name()), name.clone()))
                    .or_default() += sum as u64;
                samples.len() as u64
            }
            _ => continue,
        };
        *totals
            .entry((key.key().name().to_owned(), name))
            .or_default() += n;
    }
    totals
        .get(&(metric.to_owned(), op.to_owned()))
        .copied()
        .unwrap_or(0)
}

/// The counter `metric` for operation `name` (0 when never incremented).
fn counter(metric: &str, name: &str) -> u64 {
    total(metric, name)
}

/// How many body durations were recorded for operation `name`.
fn body_samples(name: &str) -> u64 {
    counter(m::BODY_SECONDS, name)
}

#[derive(Debug, serde::Serialize, serde::Deserialize, thiserror::Error)]
enum AppError {
    #[error("timed out")]
    Timeout,
    #[error("{0}")]
    Idem(String),
}

impl From<IdemError> for AppError {
    fn from(e: IdemError) -> Self {
        AppError::Idem(e.to_string())
    }
}

/// Held by each test: the group-commit histogram has no label to tell tests apart.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn every_answer_is_counted_by_operation_name() {
    let _serial = SERIAL.lock().await;
    recorder();
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("metrics.db").display()
    );
    let idem = Idem::sqlite(&url).await.unwrap();
    let op = "metrics_charge";
    let call = |key: &'static str, amount: u32| {
        idem.operation(op, key)
            .fingerprint(&amount)
            .retain(std::time::Duration::from_secs(86_400))
            .run(move || async move { Ok::<_, IdemError>(amount) })
    };
    call("k1", 5).await.unwrap();
    call("k1", 5).await.unwrap();
    call("k1", 5).await.unwrap();
    assert!(matches!(
        call("k1", 6).await,
        Err(IdemError::Mismatch { .. })
    ));
    assert_eq!(counter(m::CLAIMS, op), 1);
    assert_eq!(counter(m::REPLAYS, op), 2);
    assert_eq!(counter(m::MISMATCHES, op), 1);
    assert_eq!(body_samples(op), 1);

    // In flight, rejected at once.
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (release_tx, release) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.operation(op, "k2")
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async {
                    started_tx.send(()).unwrap();
                    release.await.unwrap();
                    Ok::<_, IdemError>(1)
                })
                .await
        })
    };
    started.await.unwrap();
    let rejected = idem
        .operation(op, "k2")
        .in_flight(InFlight::Reject)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(2) })
        .await;
    assert!(matches!(rejected, Err(IdemError::InFlight { .. })));
    release_tx.send(()).unwrap();
    holder.await.unwrap().unwrap();
    assert_eq!(counter(m::IN_FLIGHT, op), 1);

    // An effect in doubt: UNKNOWN.
    let doubtful = idem
        .operation(op, "k3")
        .classify(|_: &AppError| Disposition::Unknown)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Err::<u8, _>(AppError::Timeout) })
        .await;
    assert!(matches!(doubtful, Err(AppError::Timeout)));
    assert_eq!(counter(m::UNKNOWN, op), 1);

    // A stalled body past its lease: taken over, and its late outcome fenced.
    let (stalled_tx, stalled) = tokio::sync::oneshot::channel();
    let (wake_tx, wake) = tokio::sync::oneshot::channel::<()>();
    let slow = {
        // Another process's handle, whose lease is not renewed: it lapses while stalled.
        let idem = Idem::builder()
            .renew_leases(false)
            .sqlite(&url)
            .await
            .unwrap();
        tokio::spawn(async move {
            idem.operation(op, "k4")
                .lease(Duration::from_millis(50))
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async {
                    stalled_tx.send(()).unwrap();
                    wake.await.unwrap();
                    Ok::<_, IdemError>(1)
                })
                .await
        })
    };
    stalled.await.unwrap();
    let taken = loop {
        let r = idem
            .operation(op, "k4")
            .in_flight(InFlight::Reject)
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(2) })
            .await;
        match r {
            Err(IdemError::InFlight { retry_after, .. }) => tokio::time::sleep(retry_after).await,
            other => break other.unwrap(),
        }
    };
    assert_eq!(taken, 2);
    wake_tx.send(()).unwrap();
    assert!(matches!(slow.await.unwrap(), Err(IdemError::Fenced { .. })));
    assert_eq!(counter(m::TAKEOVERS, op), 1);
    assert_eq!(counter(m::FENCED, op), 1);
}

/// Every claim and record on SQLite passes through group commit and is counted in one
/// batch: concurrent fresh calls' batches hold twice as many writes as there are calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_batches_count_every_write() {
    let _serial = SERIAL.lock().await;
    recorder();
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("batches.db").display()
    );
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .sqlite(&url)
        .await
        .unwrap();
    let (batches, writes) = (
        total(m::BATCH_WRITES, ""),
        total("idem_group_commit_writes:sum", ""),
    );
    let calls: Vec<_> = (0..24u32)
        .map(|k| {
            let idem = idem.clone();
            tokio::spawn(async move {
                idem.operation("batched", &k)
                    .fingerprint_none()
                    .retain(Duration::from_secs(86_400))
                    .run(move || async move { Ok::<_, IdemError>(k) })
                    .await
            })
        })
        .collect();
    for (k, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), k as u32);
    }
    let batches = total(m::BATCH_WRITES, "") - batches;
    let writes = total("idem_group_commit_writes:sum", "") - writes;
    assert_eq!(writes, 48, "a claim and a record per call");
    assert!((1..=48).contains(&batches), "{batches} batches");
}
