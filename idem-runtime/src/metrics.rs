//! What idem counts, through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`): install any recorder (a Prometheus exporter, StatsD, …) and these appear,
//! each labelled `name` with the operation's name (never with a key or scope, which
//! would make a series per request). Without the feature nothing is recorded and the
//! facade is not compiled in.
//!
//! ```
//! # #[cfg(feature = "metrics")]
//! # mod counting {
//! #     use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
//! #     use std::collections::HashMap;
//! #     use std::sync::atomic::{AtomicU64, Ordering};
//! #     use std::sync::{Arc, Mutex};
//! #     /// Every counter's total by name, labels summed.
//! #     #[derive(Default)]
//! #     pub struct Recorder(Mutex<HashMap<String, Arc<AtomicU64>>>);
//! #     impl Recorder {
//! #         pub fn total(&self, name: &str) -> u64 {
//! #             let counters = self.0.lock().unwrap();
//! #             counters.get(name).map_or(0, |c| c.load(Ordering::Relaxed))
//! #         }
//! #     }
//! #     impl metrics::Recorder for Recorder {
//! #         fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
//! #         fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
//! #         fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
//! #         fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
//! #             let mut counters = self.0.lock().unwrap();
//! #             Counter::from_arc(counters.entry(key.name().to_owned()).or_default().clone())
//! #         }
//! #         fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge { Gauge::noop() }
//! #         fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
//! #             Histogram::noop()
//! #         }
//! #     }
//! # }
//! # #[cfg(feature = "metrics")]
//! # fn main() -> Result<(), idem_runtime::IdemError> {
//! use idem_runtime::metrics::{CLAIMS, REPLAYS};
//! use idem_runtime::{Idem, IdemError};
//! use std::time::Duration;
//!
//! // In production, a recorder installed once at startup, e.g.
//! // `metrics_exporter_prometheus::PrometheusBuilder::new().install()`.
//! let recorder = counting::Recorder::default();
//! let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
//! metrics::with_local_recorder(&recorder, || {
//!     runtime.block_on(async {
//!         let idem = Idem::memory();
//!         for _ in 0..2 {
//!             idem.operation("charge", "order-1")
//!                 .retain(Duration::from_secs(3600))
//!                 .fingerprint_none()
//!                 .run(|| async { Ok::<_, IdemError>(()) })
//!                 .await?;
//!         }
//!         Ok::<_, IdemError>(())
//!     })
//! })?;
//! assert_eq!((recorder.total(CLAIMS), recorder.total(REPLAYS)), (1, 1));
//! # Ok(()) }
//! # #[cfg(not(feature = "metrics"))]
//! # fn main() {}
//! ```
//!
//! Alert on [`UNKNOWN`] and [`FENCED`] rising: each means an effect needs a person or a
//! longer `lease`. [`Idem::stats`](crate::Idem::stats) gives the age of the oldest
//! UNKNOWN and IN_PROGRESS records for the same purpose. [`STORE_SECONDS`] shows the
//! store's latency as each operation sees it, by call (`claim`, `record`, …).
//!
//! Every metric carries a description and a unit, which exporters print (Prometheus as
//! `# HELP` and in the unit suffix): idem describes them to the recorder in place when
//! it emits its first metric, and [`describe`] does so again for a recorder installed
//! later.

/// Claims acquired (the body runs), takeovers included.
pub const CLAIMS: &str = "idem_claims_total";
/// Recorded outcomes replayed instead of running the body.
pub const REPLAYS: &str = "idem_replays_total";
/// Keys reused with another payload.
pub const MISMATCHES: &str = "idem_mismatches_total";
/// Calls answered "in flight" (or "too many waiters") after waiting as configured.
pub const IN_FLIGHT: &str = "idem_in_flight_total";
/// Calls refused for being over their caller's allowance of new claims
/// ([`IdemBuilder::limit_new_claims`](crate::IdemBuilder::limit_new_claims)).
pub const RATE_LIMITED: &str = "idem_rate_limited_total";
/// Lapsed claims taken over by another caller.
pub const TAKEOVERS: &str = "idem_takeovers_total";
/// Finishers whose claim was taken over: their outcome was refused.
pub const FENCED: &str = "idem_fenced_total";
/// Operations moved to UNKNOWN (by `classify`, an unrecordable outcome or
/// `on_takeover = unknown`).
pub const UNKNOWN: &str = "idem_unknown_total";
/// Store errors that reached a caller, labelled also `during` (`claim`, `record`).
pub const STORE_ERRORS: &str = "idem_store_errors_total";
/// Expired records deleted by a purge (no `name` label).
pub const PURGED: &str = "idem_purged_total";
/// [Steps](crate::step) run and recorded.
pub const STEPS: &str = "idem_steps_total";
/// [Steps](crate::step) replayed from their record instead of running, in a resumed
/// body.
pub const STEP_REPLAYS: &str = "idem_step_replays_total";
/// How long bodies ran, in seconds (a histogram).
pub const BODY_SECONDS: &str = "idem_body_duration_seconds";
/// Claims and records written together by one group commit (SQLite's shared
/// transactions, PostgreSQL's batched statements), a histogram with no `name` label. A
/// mean near 1 under load means the callers are not sharing commits.
pub const BATCH_WRITES: &str = "idem_group_commit_writes";
/// How long the store took to answer an operation's call, in seconds (a histogram),
/// labelled also `call` with the [`Store`](crate::store::Store) method: `claim`,
/// `peek_completed` (the replay read), `record`, `renew` (the claim's confirmation
/// when it was answered late), `release`, `mark_unknown`. A call the store did not
/// answer within its bound counts the time until it was given up. The memory store
/// answers within the process and is not timed; nor are the background lease renewals.
pub const STORE_SECONDS: &str = "idem_store_call_duration_seconds";

/// Every counter with its description, for [`describe`]; each counts events.
#[cfg(feature = "metrics")]
const COUNTERS: [(&str, &str); 12] = [
    (
        CLAIMS,
        "Claims acquired (the body runs), takeovers included.",
    ),
    (
        REPLAYS,
        "Recorded outcomes replayed instead of running the body.",
    ),
    (MISMATCHES, "Keys reused with another payload."),
    (
        IN_FLIGHT,
        "Calls answered in flight, or refused for too many waiters.",
    ),
    (
        RATE_LIMITED,
        "New claims refused for being over their caller's allowance.",
    ),
    (TAKEOVERS, "Lapsed claims taken over by another caller."),
    (
        FENCED,
        "Finishers whose claim was taken over: their outcome was refused.",
    ),
    (
        UNKNOWN,
        "Operations moved to UNKNOWN: an effect may need reconciling.",
    ),
    (STORE_ERRORS, "Store errors that reached a caller, by call."),
    (PURGED, "Expired records deleted by a purge."),
    (STEPS, "Steps run and recorded."),
    (
        STEP_REPLAYS,
        "Steps replayed from their record in a resumed body.",
    ),
];

/// Every histogram with its unit and description, for [`describe`].
#[cfg(feature = "metrics")]
const HISTOGRAMS: [(&str, metrics::Unit, &str); 3] = [
    (BODY_SECONDS, metrics::Unit::Seconds, "How long bodies ran."),
    (
        BATCH_WRITES,
        metrics::Unit::Count,
        "Claims and records written by one group commit.",
    ),
    (
        STORE_SECONDS,
        metrics::Unit::Seconds,
        "How long the store took to answer, by call.",
    ),
];

/// Gives the installed recorder every metric's description and unit. idem calls it
/// once itself, with the first metric it emits; call it after installing a recorder
/// that came later (descriptions sent before went to the recorder of that time).
/// Without the `metrics` feature it does nothing.
pub fn describe() {
    #[cfg(feature = "metrics")]
    {
        for (name, text) in COUNTERS {
            metrics::describe_counter!(name, metrics::Unit::Count, text);
        }
        for (name, unit, text) in HISTOGRAMS {
            metrics::describe_histogram!(name, unit, text);
        }
    }
}

/// [`describe`], once per process, before the first metric: one atomic load after that.
#[cfg(feature = "metrics")]
fn described() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(describe);
}

#[cfg(feature = "metrics")]
pub(crate) fn count(metric: &'static str, name: &str) {
    described();
    metrics::counter!(metric, "name" => name.to_owned()).increment(1);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_metric: &'static str, _name: &str) {}

#[cfg(feature = "metrics")]
pub(crate) fn store_error(name: &str, during: &'static str) {
    described();
    metrics::counter!(STORE_ERRORS, "name" => name.to_owned(), "during" => during).increment(1);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn store_error(_name: &str, _during: &'static str) {}

#[cfg(feature = "metrics")]
pub(crate) fn purged(rows: u64) {
    described();
    metrics::counter!(PURGED).increment(rows);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn purged(_rows: u64) {}

#[cfg(all(feature = "metrics", feature = "_sql_group"))]
pub(crate) fn batch(writes: usize) {
    described();
    metrics::histogram!(BATCH_WRITES).record(writes as f64);
}

#[cfg(all(not(feature = "metrics"), feature = "_sql_group"))]
pub(crate) fn batch(_writes: usize) {}

#[cfg(feature = "metrics")]
pub(crate) fn body_time(name: &str, took: std::time::Duration) {
    described();
    metrics::histogram!(BODY_SECONDS, "name" => name.to_owned()).record(took.as_secs_f64());
}

/// Times one call to the store for [`STORE_SECONDS`], from its first poll until it
/// answers or is dropped (given up at its bound, or its caller went away).
#[cfg(feature = "metrics")]
pub(crate) async fn store_call<F: std::future::Future>(
    name: &str,
    call: &'static str,
    fut: F,
) -> F::Output {
    struct Timer<'a> {
        name: &'a str,
        call: &'static str,
        started: std::time::Instant,
    }
    impl Drop for Timer<'_> {
        fn drop(&mut self) {
            described();
            metrics::histogram!(STORE_SECONDS, "name" => self.name.to_owned(), "call" => self.call)
                .record(self.started.elapsed().as_secs_f64());
        }
    }
    let _timer = Timer {
        name,
        call,
        started: std::time::Instant::now(),
    };
    fut.await
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn store_call<F: std::future::Future>(_name: &str, _call: &'static str, fut: F) -> F {
    fut
}
