//! Steps: several effects in one operation, each run once and recorded before the next.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::bounded::bounded;
use crate::context::{self, Body};
use crate::error::{IdemError, StoreError};
use crate::idem::Idem;
use crate::lease::known_lost;
use crate::seal::Part;
use crate::step_state::StepsMode;
use crate::store::{Fence, StepRecord, StoredOutcome};

/// The longest label a step may have, in bytes: labels are stored beside the operation.
pub const MAX_STEP_LABEL: usize = 255;

/// Version of a step's encoded value. Steps are replayed only into the body that
/// recorded them, so their values carry no schema version of the operation's.
const STEP_VERSION: u32 = 1;

/// Inside an idempotent body: runs `f` once per operation and records its `Ok` value
/// under the operation before returning it; on a later run of the body (a retry after a
/// released error, a takeover after a crash, a retry after
/// [`resolve(.., Retry)`](crate::Idem::resolve)) returns the recorded value without
/// running `f`.
///
/// Each step is an effect with its own identity: a checkout reserves stock, charges a
/// card and sends a receipt, and a retry after the receipt failed resumes at the
/// receipt instead of charging again.
///
/// - **Recorded once.** The `Ok` value is written to the store, fenced by the
///   attempt's epoch, before `step` returns: one round trip. An `Err` is not recorded,
///   and the step runs again on the next run of the body.
/// - **Released errors resume.** When the body's error releases the claim, its
///   completed steps stay, and so does the request's fingerprint: a retry with another
///   request is [`IdemError::Mismatch`]. They stay for the operation's `retain`,
///   counted from the release; past it the operation expires like a completed one, and
///   the next call, with any request, runs afresh without them.
/// - **Takeovers resume.** After a crash, the taker replays every recorded step and
///   runs the rest. A step that crashed mid-way runs again, with the same
///   [`downstream_key`](crate::Current::downstream_key) for its label, so a provider
///   that deduplicates sees one effect.
/// - **Calls keyed by the label.** While `f` runs, [`Current::step`](crate::Current::step)
///   is the label, and the client layers of `idem_runtime::client` (feature `client`)
///   key the step's first call by it, as `downstream_key(label)` does.
/// - **Fenced.** An attempt that lost its claim cannot record a step: `step` returns
///   [`IdemError::Fenced`], and the taker's outcome stands. Once the claim's renewals
///   have found it gone, `step` returns that before running `f` at all.
/// - **Unrecorded steps are not run again.** A step whose value cannot be recorded (it
///   does not serialize, it is over `max_outcome_bytes`, the store failed) returns an
///   error; if the body then ends in a released error, the operation is parked in
///   UNKNOWN instead, since a retry would repeat the step's effect.
/// - **Labels** may be built at run time (`&format!("email:{id}")`), must be non-empty,
///   at most [`MAX_STEP_LABEL`] bytes and free of NUL characters (which PostgreSQL
///   cannot store; the rule is the same on every store), and unique within one run of
///   the body. A label that breaks these rules, a label used twice, a `step` outside an idempotent body, and a `step` in a
///   transactional body (whose transaction is already one unit) are
///   [`IdemError::Config`], and `f` does not run.
///
/// A completed operation replays its final outcome; its steps are neither read nor run.
/// An operation in UNKNOWN lists its steps in [`Idem::get`](crate::Idem::get).
///
/// ```
/// use idem_runtime::{Idem, IdemError, step};
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// let charges = AtomicU32::new(0);
/// let checkout = |fail_receipt: bool| {
///     let charges = &charges;
///     idem.operation("checkout", "order-1")
///         .retain(Duration::from_secs(3600))
///         .fingerprint(&100u64)
///         .run(move || async move {
///             let paid: u64 = step("charge", || async {
///                 charges.fetch_add(1, Ordering::Relaxed);
///                 Ok::<_, IdemError>(100)
///             })
///             .await?;
///             step("receipt", || async move {
///                 if fail_receipt {
///                     return Err(IdemError::Config { message: "mail down".into() });
///                 }
///                 Ok(())
///             })
///             .await?;
///             Ok::<_, IdemError>(paid)
///         })
/// };
/// assert!(checkout(true).await.is_err()); // charged; the receipt failed: released
/// assert_eq!(checkout(false).await?, 100); // resumed: the charge replays
/// assert_eq!(charges.load(Ordering::Relaxed), 1);
/// # Ok(()) }
/// ```
pub async fn step<T, E, F, Fut>(label: &str, f: F) -> Result<T, E>
where
    T: Serialize + DeserializeOwned,
    E: From<IdemError>,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let at = match start(label) {
        Ok(at) => at,
        Err(e) => return Err(e.into()),
    };
    let (idem, id, epoch) = match at {
        Start::Unprotected => return context::in_step(label, f()).await,
        Start::Leased {
            idem,
            resume,
            id,
            epoch,
        } => {
            if resume && let Some(recorded) = recorded(&idem, &id, label).await? {
                tracing::debug!(label, "step replayed");
                crate::metrics::count(crate::metrics::STEP_REPLAYS, &id.name);
                return decode(&idem, &id, label, &recorded).map_err(E::from);
            }
            (idem, id, epoch)
        }
    };
    // The label is visible to what `f` calls: `current().step()`, the client layers.
    let value = context::in_step(label, f()).await?;
    let outcome = match encode(&idem, &id, label, &value) {
        Ok(outcome) => outcome,
        Err(e) => {
            mark_unrecorded();
            return Err(e.into());
        }
    };
    match write(&idem, &id, epoch, label, &outcome).await {
        Ok(Fence::Held) => {
            tracing::debug!(epoch, label, "step recorded");
            crate::metrics::count(crate::metrics::STEPS, &id.name);
            Ok(value)
        }
        Ok(Fence::Lost) => {
            tracing::warn!(
                epoch,
                label,
                "fenced: step not recorded; another claim owns the operation"
            );
            crate::metrics::count(crate::metrics::FENCED, &id.name);
            Err(IdemError::Fenced {
                name: id.name.clone(),
                epoch,
            }
            .into())
        }
        Err(e) => {
            mark_unrecorded();
            tracing::error!(epoch, label, error = %e, "step ran but its value is unrecorded");
            crate::metrics::store_error(&id.name, "record step");
            Err(IdemError::Unrecorded {
                name: format!("{}` step `{label}", id.name),
                epoch,
                source: e.source,
            }
            .into())
        }
    }
}

enum Start {
    Unprotected,
    Leased {
        idem: Idem,
        resume: bool,
        id: std::sync::Arc<crate::OperationId>,
        epoch: u64,
    },
}

/// Checks the label and claims it for this run, before anything runs.
fn start(label: &str) -> Result<Start, IdemError> {
    let config = |message: String| IdemError::Config { message };
    if label.is_empty() || label.len() > MAX_STEP_LABEL {
        return Err(config(format!(
            "a step label must be 1 to {MAX_STEP_LABEL} bytes, and {label:?} is {} bytes; \
             name the effect (\"charge\", \"email:{{id}}\")",
            label.len()
        )));
    }
    // PostgreSQL `TEXT` cannot hold a NUL: refused here, on every store, so a label is
    // never found unstorable only after its effect ran.
    if label.contains('\0') {
        return Err(config(format!(
            "step label {label:?} contains a NUL character, which not every store can keep; \
             build labels from printable text (\"email:{{id}}\")"
        )));
    }
    let started = context::with_body(|body: &Body| {
        let name = body.current.name();
        if let StepsMode::Transactional = body.steps {
            return Err(config(format!(
                "step {label:?} of operation `{name}` runs in a transactional body, which is \
                 already one unit (its statements commit or roll back together); make the \
                 effect a statement of the transaction, or run the operation leased"
            )));
        }
        let mut run = body.run.borrow_mut();
        let run = run.get_or_insert_default();
        if !run.labels.get_or_insert_default().insert(label.into()) {
            return Err(config(format!(
                "step label {label:?} is used twice in one run of operation `{name}`; give \
                 each step its own label (\"email:{{id}}\" in a loop)"
            )));
        }
        Ok(match &body.steps {
            // A renewal found the claim gone: another attempt owns the operation, and a
            // step run here would be its effect a second time.
            StepsMode::Leased(_, Some(held)) | StepsMode::Resumed(_, Some(held))
                if known_lost(held) =>
            {
                return Err(IdemError::Fenced {
                    name: name.to_owned(),
                    epoch: body.current.epoch(),
                });
            }
            StepsMode::Leased(idem, _) | StepsMode::Resumed(idem, _) => Start::Leased {
                idem: idem.clone(),
                resume: matches!(body.steps, StepsMode::Resumed(..)),
                id: body.current.shared_id(),
                epoch: body.current.epoch(),
            },
            StepsMode::Unprotected | StepsMode::Transactional => Start::Unprotected,
        })
    });
    started.unwrap_or_else(|| {
        Err(config(format!(
            "step {label:?} called outside an idempotent body; call it inside the body of \
             an #[idempotent] function or of `Operation::run`"
        )))
    })
}

fn mark_unrecorded() {
    context::with_body(|body| body.run.borrow_mut().get_or_insert_default().unrecorded = true);
}

/// The recorded value of `label`, read from the store at the first step of a resumed
/// run, and from this run's copy after.
async fn recorded(
    idem: &Idem,
    id: &crate::OperationId,
    label: &str,
) -> Result<Option<StoredOutcome>, IdemError> {
    let known = context::with_body(|body| {
        let run = body.run.borrow();
        let recorded = run.as_ref().and_then(|r| r.recorded.as_ref());
        recorded.map(|r| r.get(label).cloned())
    })
    .flatten();
    // Read already: the label was recorded, or it was not.
    if let Some(found) = known {
        return Ok(found);
    }
    let read = bounded(
        idem.store_timeout(),
        "read of recorded steps",
        idem.store().steps(id),
    );
    let steps: Vec<StepRecord> = read.await.map_err(|e| IdemError::store("step read", e))?;
    let map: HashMap<String, StoredOutcome> =
        steps.into_iter().map(|s| (s.label, s.outcome)).collect();
    let found = map.get(label).cloned();
    context::with_body(|body| body.run.borrow_mut().get_or_insert_default().recorded = Some(map));
    Ok(found)
}

fn decode<T: DeserializeOwned>(
    idem: &Idem,
    id: &crate::OperationId,
    label: &str,
    outcome: &StoredOutcome,
) -> Result<T, IdemError> {
    let part = Part::Step(label);
    let body = idem.open(id, part, outcome.is_err, outcome.version, &outcome.body)?;
    serde_json::from_slice(&body).map_err(|e| IdemError::Codec {
        name: id.name.clone(),
        message: format!(
            "cannot decode the recorded value of step {label:?} as this build's type: {e}; \
             the step's type changed while the operation was unfinished, so resolve the \
             operation"
        ),
    })
}

fn encode<T: Serialize>(
    idem: &Idem,
    id: &crate::OperationId,
    label: &str,
    value: &T,
) -> Result<StoredOutcome, IdemError> {
    let body = serde_json::to_vec(value).map_err(|e| IdemError::Codec {
        name: id.name.clone(),
        message: format!(
            "step {label:?} ran but its value cannot be serialized ({e}), so it is not \
             recorded; a released error now parks the operation in UNKNOWN"
        ),
    })?;
    let max = idem.max_outcome_bytes();
    if body.len() > max {
        // The step's effect happened: a release would run it again.
        return Err(IdemError::OutcomeTooLarge {
            name: format!("{}` step `{label}", id.name),
            len: body.len(),
            max,
            in_doubt: true,
        });
    }
    // Sealed when the `Idem` encrypts, bound to the operation and this label.
    let body = idem.seal(id, Part::Step(label), false, STEP_VERSION, body)?;
    Ok(StoredOutcome::new(body, false, STEP_VERSION))
}

/// Writes the step, retrying a retryable store error with backoff for at most the
/// store timeout (the renewals keep the claim meanwhile); every attempt is fenced, so a
/// late one changes nothing once another claim owns the operation.
async fn write(
    idem: &Idem,
    id: &crate::OperationId,
    epoch: u64,
    label: &str,
    outcome: &StoredOutcome,
) -> Result<Fence, StoreError> {
    let started = Instant::now();
    let window = idem.store_timeout();
    let mut backoff = Duration::from_millis(20);
    loop {
        let bound = window.saturating_sub(started.elapsed()).max(backoff);
        let write = idem.store().record_step(id, epoch, label, outcome);
        let e = match bounded(bound, "step's record", write).await {
            Ok(fence) => return Ok(fence),
            Err(e) => e,
        };
        if !e.retryable || started.elapsed() + backoff >= window {
            return Err(e);
        }
        tracing::warn!(epoch, label, error = %e, "step record failed; retrying");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}
