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
//! UNKNOWN and IN_PROGRESS records for the same purpose.

/// Claims acquired (the body runs), takeovers included.
pub const CLAIMS: &str = "idem_claims_total";
/// Recorded outcomes replayed instead of running the body.
pub const REPLAYS: &str = "idem_replays_total";
/// Keys reused with another payload.
pub const MISMATCHES: &str = "idem_mismatches_total";
/// Calls answered "in flight" (or "too many waiters") after waiting as configured.
pub const IN_FLIGHT: &str = "idem_in_flight_total";
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

#[cfg(feature = "metrics")]
pub(crate) fn count(metric: &'static str, name: &str) {
    metrics::counter!(metric, "name" => name.to_owned()).increment(1);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_metric: &'static str, _name: &str) {}

#[cfg(feature = "metrics")]
pub(crate) fn store_error(name: &str, during: &'static str) {
    metrics::counter!(STORE_ERRORS, "name" => name.to_owned(), "during" => during).increment(1);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn store_error(_name: &str, _during: &'static str) {}

#[cfg(feature = "metrics")]
pub(crate) fn purged(rows: u64) {
    metrics::counter!(PURGED).increment(rows);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn purged(_rows: u64) {}

#[cfg(all(feature = "metrics", any(feature = "sqlite", feature = "postgres")))]
pub(crate) fn batch(writes: usize) {
    metrics::histogram!(BATCH_WRITES).record(writes as f64);
}

#[cfg(all(
    not(feature = "metrics"),
    any(feature = "sqlite", feature = "postgres")
))]
pub(crate) fn batch(_writes: usize) {}

#[cfg(feature = "metrics")]
pub(crate) fn body_time(name: &str, took: std::time::Duration) {
    metrics::histogram!(BODY_SECONDS, "name" => name.to_owned()).record(took.as_secs_f64());
}
