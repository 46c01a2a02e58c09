//! What an operation does in the cases its options decide: a duplicate in flight, a
//! store out of reach, the body's `Err` (released, recorded or classified), and an
//! outcome recorded under another schema version.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::DEFAULT_WAIT;
use crate::error::IdemError;

/// What a duplicate does when it finds the operation running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// Wait up to this long for the running call to finish (woken when it does), then
    /// answer [`IdemError::InFlight`].
    Wait(Duration),
    /// Answer [`IdemError::InFlight`] at once.
    Reject,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight::Wait(DEFAULT_WAIT)
    }
}

/// What happens when the store cannot be reached at claim time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnStoreError {
    /// Return [`IdemError::Store`]; the body does not run.
    #[default]
    FailClosed,
    /// Run the body unprotected and emit a warning event, for effects where a
    /// duplicate is cheaper than an outage. Not once the store has said another call
    /// is running the operation: a store error while waiting on it fails closed.
    FailOpen,
}

/// What an `Err` from the body means, as a `classify` function decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Nothing happened: release the claim so a retry runs the body again.
    Release,
    /// A final answer: record it and replay it to every duplicate.
    Record,
    /// The effect may have happened: move the operation to UNKNOWN; duplicates get
    /// [`IdemError::Unknown`] until it is resolved.
    Unknown,
}

/// How an operation treats the body's `Err`. Chosen with [`Operation::record_errors`](crate::Operation::record_errors)
/// and [`Operation::classify`](crate::Operation::classify); the default is [`ReleaseErrors`].
pub trait ErrorPolicy<E> {
    /// What this error means.
    fn disposition(&self, error: &E) -> Disposition;
    /// The error as JSON, for recording.
    fn encode(&self, error: &E) -> Result<Vec<u8>, String>;
    /// A recorded error, for replay.
    fn decode(&self, bytes: &[u8]) -> Result<E, String>;
}

/// Every `Err` releases the claim (the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReleaseErrors;

impl<E> ErrorPolicy<E> for ReleaseErrors {
    fn disposition(&self, _: &E) -> Disposition {
        Disposition::Release
    }
    fn encode(&self, _: &E) -> Result<Vec<u8>, String> {
        Err("this operation releases errors and cannot record them".into())
    }
    fn decode(&self, _: &[u8]) -> Result<E, String> {
        Err(
            "a recorded error was found, but this operation releases errors; \
             was it built with `errors = record` before?"
                .into(),
        )
    }
}

/// An error type that [`RecordErrors`] and [`Classify`] (`errors = record`,
/// `classify = ...`) can record and replay: every `E: Serialize + DeserializeOwned`, and
/// nothing else (there is nothing to implement by hand). It exists for its compile
/// error, which says what to do where serde's own would point into idem's internals.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be recorded: `errors = record` and `classify` store the error \
               and replay it, so it must be `Serialize + DeserializeOwned`",
    label = "the error type `{Self}` is not `Serialize + DeserializeOwned`",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`; a variant that \
            holds an `IdemError` (which is not serializable) takes `#[serde(skip)]`: idem's \
            own errors are answered to the caller, not recorded"
)]
pub trait RecordableError: Serialize + DeserializeOwned {}

// Reported as `E: RecordableError` with the message above, not as the serde bound
// behind it that `E` misses.
#[diagnostic::do_not_recommend]
impl<E: Serialize + DeserializeOwned> RecordableError for E {}

/// An `Ok` type that [`Operation::run`](crate::Operation::run) can record and replay: every
/// `T: Serialize + DeserializeOwned`, and nothing else (there is nothing to implement by
/// hand). It exists for its compile error: a response wrapper returned by mistake (axum's
/// or rmcp's `Json<T>`, which have no serde impls) is told what to return instead.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be recorded: the outcome of an idempotent operation is stored \
               and replayed, so it must be `Serialize + DeserializeOwned`",
    label = "the outcome type `{Self}` is not `Serialize + DeserializeOwned`",
    note = "a response wrapper such as axum's or rmcp's `Json<T>` has no serde impls: return \
            `T` from the `#[idempotent]` function (or the body given to `run`) and wrap it in \
            `Json` outside it, in the handler that calls it",
    note = "for a type of your own, derive `serde::Serialize` and `serde::Deserialize`"
)]
pub trait RecordableOutcome: Serialize + DeserializeOwned {}

// Reported as `T: RecordableOutcome` with the message above, not as the serde bounds
// behind it that `T` misses.
#[diagnostic::do_not_recommend]
impl<T: Serialize + DeserializeOwned> RecordableOutcome for T {}

/// Every `Err` is recorded and replayed like a success.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordErrors;

impl<E: RecordableError> ErrorPolicy<E> for RecordErrors {
    fn disposition(&self, _: &E) -> Disposition {
        Disposition::Record
    }
    fn encode(&self, error: &E) -> Result<Vec<u8>, String> {
        serde_json::to_vec(error).map_err(|e| e.to_string())
    }
    fn decode(&self, bytes: &[u8]) -> Result<E, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }
}

/// A function decides per error.
#[derive(Clone, Copy, Debug)]
pub struct Classify<F>(pub(super) F);

impl<E: RecordableError, F: Fn(&E) -> Disposition> ErrorPolicy<E> for Classify<F> {
    fn disposition(&self, error: &E) -> Disposition {
        (self.0)(error)
    }
    fn encode(&self, error: &E) -> Result<Vec<u8>, String> {
        RecordErrors.encode(error)
    }
    fn decode(&self, bytes: &[u8]) -> Result<E, String> {
        RecordErrors.decode(bytes)
    }
}

/// How an outcome recorded under another schema version becomes today's `T`.
pub trait Upgrade<T> {
    /// Converts the outcome recorded under `from` (as JSON) for the operation `name`.
    fn upgrade(
        &self,
        name: &str,
        from: u32,
        to: u32,
        outcome: serde_json::Value,
    ) -> Result<T, IdemError>;
}

/// No upgrade: an outcome of another version is an [`IdemError::Codec`].
#[derive(Clone, Copy, Debug, Default)]
pub struct NoUpgrade;

impl<T> Upgrade<T> for NoUpgrade {
    fn upgrade(
        &self,
        name: &str,
        from: u32,
        to: u32,
        _: serde_json::Value,
    ) -> Result<T, IdemError> {
        Err(IdemError::Codec {
            name: name.to_owned(),
            message: format!(
                "the recorded outcome has schema version {from} but this build expects \
                 version {to}; add `upgrade = fn(u32, serde_json::Value) -> Result<T, IdemError>` \
                 to convert it, or wait for the old records to expire"
            ),
        })
    }
}

/// An upgrade function, set with [`Operation::upgrade`](crate::Operation::upgrade).
#[derive(Clone, Copy, Debug)]
pub struct UpgradeWith<F>(pub(super) F);

impl<T, F: Fn(u32, serde_json::Value) -> Result<T, IdemError>> Upgrade<T> for UpgradeWith<F> {
    fn upgrade(
        &self,
        _: &str,
        from: u32,
        _: u32,
        outcome: serde_json::Value,
    ) -> Result<T, IdemError> {
        (self.0)(from, outcome)
    }
}
