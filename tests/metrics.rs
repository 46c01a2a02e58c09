//! The counters and the body and store histograms, read back from a real recorder, and
//! the description and unit every metric carries.

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

/// One series as the tests read it: the metric's name and its `name` and `call` labels
/// (empty when absent).
type Series = (String, String, String);

/// Everything recorded so far, and each metric's unit and description: the snapshotter
/// hands out counter increments and histogram samples once, so they are accumulated here.
fn seen<T>(read: impl FnOnce(&HashMap<Series, u64>, &HashMap<String, Described>) -> T) -> T {
    type Seen = (HashMap<Series, u64>, HashMap<String, Described>);
    static SEEN: Mutex<Option<Seen>> = Mutex::new(None);
    let mut guard = SEEN.lock().unwrap();
    let (totals, described) = guard.get_or_insert_with(Default::default);
    for (key, unit, description, value) in recorder().snapshot().into_vec() {
        let label = |name: &str| {
            key.key()
                .labels()
                .find(|l| l.key() == name)
                .map_or(String::new(), |l| l.value().to_owned())
        };
        let (name, call) = (label("name"), label("call"));
        let metric = key.key().name().to_owned();
        if let Some(description) = description {
            described.insert(metric.clone(), (unit, description.to_string()));
        }
        let n = match (key.kind(), value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => n,
            (MetricKind::Histogram, DebugValue::Histogram(samples)) => {
                let sum: f64 = samples.iter().map(|s| s.into_inner()).sum();
                *totals
                    .entry((format!("{metric}:sum"), name.clone(), call.clone()))
                    .or_default() += sum as u64;
                samples.len() as u64
            }
            _ => continue,
        };
        *totals.entry((metric, name, call)).or_default() += n;
    }
    read(totals, described)
}

/// A metric's unit and description as the recorder received them.
type Described = (Option<metrics::Unit>, String);

/// The total of `metric` for operation `op`, every `call` label summed.
fn total(metric: &str, op: &str) -> u64 {
    seen(|totals, _| {
        totals
            .iter()
            .filter(|((m, name, _), _)| m == metric && name == op)
            .map(|(_, n)| n)
            .sum()
    })
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

/// Each store call an operation makes is timed, labelled with the operation's name and
/// the call; the metrics reach the recorder described, with their units, without the
/// application asking.
#[tokio::test]
async fn store_calls_are_timed_and_every_metric_described() {
    let _serial = SERIAL.lock().await;
    recorder();
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("store.db").display()
    );
    let idem = Idem::sqlite(&url).await.unwrap();
    let op = "metrics_store_calls";
    let samples = |call: &str| {
        seen(|totals, _| {
            let series = (m::STORE_SECONDS.to_owned(), op.to_owned(), call.to_owned());
            totals.get(&series).copied().unwrap_or(0)
        })
    };
    let (claims, records) = (samples("claim"), samples("record"));
    idem.operation(op, "k1")
        .fingerprint_none()
        .retain(Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(1) })
        .await
        .unwrap();
    assert_eq!(samples("claim") - claims, 1);
    assert_eq!(samples("record") - records, 1);

    use metrics::Unit::{Count, Seconds};
    seen(|_, described| {
        for (metric, unit) in [
            (m::CLAIMS, Count),
            (m::BODY_SECONDS, Seconds),
            (m::BATCH_WRITES, Count),
            (m::STORE_SECONDS, Seconds),
        ] {
            let (got, text) = described
                .get(metric)
                .unwrap_or_else(|| panic!("{metric} reached the recorder undescribed"));
            assert_eq!(*got, Some(unit), "{metric}");
            assert!(!text.is_empty(), "{metric}");
        }
    });
}

/// `describe()` names every metric idem emits, with its unit, to the recorder in place.
#[test]
fn describe_gives_every_metric_a_description_and_a_unit() {
    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};

    /// One description: the metric's kind, name, unit and text.
    type Described = (&'static str, String, Option<Unit>, String);
    /// The descriptions it is given, by kind.
    #[derive(Default)]
    struct Descriptions(Mutex<Vec<Described>>);
    impl Descriptions {
        fn add(&self, kind: &'static str, key: KeyName, unit: Option<Unit>, text: SharedString) {
            let entry = (kind, key.as_str().to_owned(), unit, text.to_string());
            self.0.lock().unwrap().push(entry);
        }
    }
    impl metrics::Recorder for Descriptions {
        fn describe_counter(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
            self.add("counter", key, unit, text);
        }
        fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
            self.add("gauge", key, unit, text);
        }
        fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
            self.add("histogram", key, unit, text);
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    let recorder = Descriptions::default();
    metrics::with_local_recorder(&recorder, m::describe);
    let described = recorder.0.into_inner().unwrap();
    let counters = [
        m::CLAIMS,
        m::REPLAYS,
        m::MISMATCHES,
        m::IN_FLIGHT,
        m::RATE_LIMITED,
        m::TAKEOVERS,
        m::FENCED,
        m::UNKNOWN,
        m::STORE_ERRORS,
        m::PURGED,
        m::STEPS,
        m::STEP_REPLAYS,
    ];
    let histograms = [
        (m::BODY_SECONDS, Unit::Seconds),
        (m::BATCH_WRITES, Unit::Count),
        (m::STORE_SECONDS, Unit::Seconds),
    ];
    let expected = counters
        .iter()
        .map(|&name| ("counter", name, Unit::Count))
        .chain(
            histograms
                .iter()
                .map(|&(name, unit)| ("histogram", name, unit)),
        );
    for (kind, name, unit) in expected {
        let found = described.iter().find(|(_, n, _, _)| n == name);
        let Some((got_kind, _, got_unit, text)) = found else {
            panic!("{name} is not described: {described:?}");
        };
        assert_eq!((*got_kind, *got_unit), (kind, Some(unit)), "{name}");
        assert!(!text.is_empty(), "{name}");
    }
    assert_eq!(
        described.len(),
        counters.len() + histograms.len(),
        "{described:?}"
    );
}
