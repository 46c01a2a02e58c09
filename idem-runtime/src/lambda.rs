//! Idempotent AWS Lambda handlers on `lambda_runtime` (feature `lambda`): an invocation
//! is a claim, a run of the handler and a record, so a retried invocation (an
//! asynchronous invocation's two retries, an event source's redelivery, a client's
//! retry) gets the recorded response instead of running the handler again.
//!
//! [`IdempotentLambda`] wraps a handler (any `tower::Service<LambdaEvent<E>>`, such as
//! `lambda_runtime::service_fn(f)`); [`SqsBatch`] runs each record of an SQS batch
//! idempotently and answers the records that failed as partial batch failures, so a
//! redelivered batch runs only those. Both bound the claim's lease by the invocation's
//! deadline: when Lambda stops an invocation at its timeout, the claim lapses about then,
//! and the next attempt takes it over.
//!
//! ```no_run
//! use idem_runtime::Idem;
//! use idem_runtime::lambda::IdempotentLambda;
//! use lambda_runtime::{LambdaEvent, service_fn};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Payment { payment_id: String, cents: u64 }
//!
//! #[derive(Serialize, Deserialize)]
//! struct Receipt { charge: String }
//!
//! async fn charge(event: LambdaEvent<Payment>) -> Result<Receipt, lambda_runtime::Error> {
//!     Ok(Receipt { charge: format!("ch_{}", event.payload.payment_id) })
//! }
//!
//! # async fn run() -> Result<(), lambda_runtime::Error> {
//! let idem = Idem::connect("dynamodb://idem_operations").await?;
//! let handler = IdempotentLambda::new(idem, "charge")
//!     .key(|p: &Payment| Some(p.payment_id.clone()))
//!     .wrap(service_fn(charge));
//! lambda_runtime::run(handler).await
//! # }
//! ```
//!
//! # Beside Powertools' idempotency utility
//!
//! | Powertools | here |
//! |---|---|
//! | `event_key_jmespath` | [`key`](IdempotentLambda::key) (a closure, typed) or [`key_path`](IdempotentLambda::key_path) (a JSON pointer, RFC 6901) |
//! | `payload_validation_jmespath` | [`fingerprint_path`](IdempotentLambda::fingerprint_path): another payload under the key is refused (`IdemError::Mismatch`) |
//! | `raise_on_no_idempotency_key` | [`on_missing_key`](IdempotentLambda::on_missing_key): [`MissingKey::Refuse`] or [`MissingKey::Run`] |
//! | `expires_after_seconds` | [`retain`](IdempotentLambda::retain) |
//! | in-progress expiry from the remaining time | the claim's lease, bounded by `Context::deadline` |
//! | DynamoDB persistence layer | [`Idem::dynamodb`](crate::Idem::dynamodb), or any of idem's stores |
//! | batch utility with idempotency | [`SqsBatch`] |
//! | (none) | fencing of a superseded attempt, steps, UNKNOWN for an effect in doubt, hashed keys, encrypted outcomes |

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lambda_events::event::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent, SqsMessage};
use lambda_runtime::LambdaEvent;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::{Service, ServiceExt};

use crate::Idem;

/// The error a wrapped handler answers Lambda with.
pub type Error = lambda_runtime::Error;

/// A handler's error inside idem's call: `From<IdemError>` without the blanket
/// conversion into a boxed error, whose lifetime-generic impl a spawned invocation's
/// `Send` bound cannot see through.
#[derive(Debug)]
struct Failed(Error);

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<crate::IdemError> for Failed {
    fn from(e: crate::IdemError) -> Self {
        Failed(Box::new(e))
    }
}

/// The shortest lease an invocation's claim gets, however close its deadline: a claim
/// must outlive its own write.
const MIN_LEASE: Duration = Duration::from_secs(1);

/// What an invocation whose event has no key does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissingKey {
    /// Fails without running the handler (the default): an event the function cannot
    /// key is a bug to see, not a charge to make twice.
    #[default]
    Refuse,
    /// Runs the handler unprotected, as a function without idem would.
    Run,
}

type KeyFn<E> = dyn Fn(&E) -> Option<String> + Send + Sync;

/// How an invocation's key or fingerprint is read from its event.
enum Pick<E> {
    Fn(Arc<KeyFn<E>>),
    /// A JSON pointer into the serialized event.
    Path(String),
}

impl<E> Clone for Pick<E> {
    fn clone(&self) -> Self {
        match self {
            Pick::Fn(f) => Pick::Fn(f.clone()),
            Pick::Path(p) => Pick::Path(p.clone()),
        }
    }
}

/// The JSON of `value` at `pointer`: a string as it is, another value as its JSON.
fn at_pointer(value: &serde_json::Value, pointer: &str) -> Option<String> {
    match value.pointer(pointer)? {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

/// The claim's lease for an invocation due to end at `deadline_ms` (ms since the UNIX
/// epoch; 0 when unknown): at most `lease`, at most the time left.
fn lease_until(deadline_ms: u64, lease: Duration) -> Duration {
    if deadline_ms == 0 {
        return lease;
    }
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let left = Duration::from_millis(deadline_ms.saturating_sub(now_ms));
    lease.min(left).max(MIN_LEASE)
}

/// An idempotent Lambda handler, configured, then [`wrap`](Self::wrap)ped around the
/// handler; see the [module](self).
pub struct IdempotentLambda<E> {
    idem: Idem,
    name: String,
    key: Option<Pick<E>>,
    fingerprint: Option<Pick<E>>,
    missing: MissingKey,
    retain: Duration,
    lease: Duration,
}

impl<E: Serialize + Send + 'static> IdempotentLambda<E> {
    /// The handler's operation `name` on `idem`: retained a day, its lease at most 15
    /// minutes (Lambda's longest timeout) and never past the invocation's deadline, the
    /// key to be set with [`key`](Self::key) or [`key_path`](Self::key_path).
    pub fn new(idem: Idem, name: &str) -> Self {
        IdempotentLambda {
            idem,
            name: name.to_owned(),
            key: None,
            fingerprint: None,
            missing: MissingKey::Refuse,
            retain: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(15 * 60),
        }
    }

    /// The key of an event: one business intent (a payment id, an order id), the same on
    /// every retry; `None` when the event has none.
    #[must_use]
    pub fn key(mut self, key: impl Fn(&E) -> Option<String> + Send + Sync + 'static) -> Self {
        self.key = Some(Pick::Fn(Arc::new(key)));
        self
    }

    /// The key at a JSON pointer into the event (`/detail/payment_id`): a string as it
    /// is, a number or an object as its JSON; absent or `null` is no key.
    #[must_use]
    pub fn key_path(mut self, pointer: &str) -> Self {
        self.key = Some(Pick::Path(pointer.to_owned()));
        self
    }

    /// Binds the key to the part of the event at a JSON pointer (`""` for the whole
    /// event): an event with the same key and another value there is refused
    /// ([`IdemError::Mismatch`](crate::IdemError::Mismatch)). Without it, the key alone
    /// decides.
    #[must_use]
    pub fn fingerprint_path(mut self, pointer: &str) -> Self {
        self.fingerprint = Some(Pick::Path(pointer.to_owned()));
        self
    }

    /// What an event without a key does (default [`MissingKey::Refuse`]).
    #[must_use]
    pub fn on_missing_key(mut self, missing: MissingKey) -> Self {
        self.missing = missing;
        self
    }

    /// How long a response is kept for retries (default a day).
    #[must_use]
    pub fn retain(mut self, retain: Duration) -> Self {
        self.retain = retain;
        self
    }

    /// The longest lease of an invocation's claim (default 15 minutes); the deadline
    /// bounds it further.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The handler, made idempotent: a `tower::Service` for `lambda_runtime::run`. The
    /// handler answers [`Error`] (`lambda_runtime::Error`), as `service_fn` handlers do.
    ///
    /// # Panics
    ///
    /// If no key was set ([`key`](Self::key) or [`key_path`](Self::key_path)).
    pub fn wrap<S>(self, inner: S) -> IdempotentService<E, S> {
        let key = self.key.clone().expect(
            "IdempotentLambda: set the event's key with `.key(|event| ...)` or \
             `.key_path(\"/pointer\")` before `wrap`",
        );
        IdempotentService {
            cfg: Arc::new(Config {
                idem: self.idem,
                name: self.name,
                key,
                fingerprint: self.fingerprint,
                missing: self.missing,
                retain: self.retain,
                lease: self.lease,
            }),
            inner,
        }
    }
}

struct Config<E> {
    idem: Idem,
    name: String,
    key: Pick<E>,
    fingerprint: Option<Pick<E>>,
    missing: MissingKey,
    retain: Duration,
    lease: Duration,
}

/// A handler made idempotent by [`IdempotentLambda::wrap`].
pub struct IdempotentService<E, S> {
    cfg: Arc<Config<E>>,
    inner: S,
}

impl<E, S: Clone> Clone for IdempotentService<E, S> {
    fn clone(&self) -> Self {
        IdempotentService {
            cfg: self.cfg.clone(),
            inner: self.inner.clone(),
        }
    }
}

impl<E, S, R> Service<LambdaEvent<E>> for IdempotentService<E, S>
where
    E: Serialize + Send + Sync + 'static,
    S: Service<LambdaEvent<E>, Response = R, Error = Error> + Clone + Send + 'static,
    S::Future: Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    type Response = R;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<R, Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, event: LambdaEvent<E>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        Box::pin(invoke(cfg, inner, event))
    }
}

async fn invoke<E, S, R>(cfg: Arc<Config<E>>, inner: S, event: LambdaEvent<E>) -> Result<R, Error>
where
    E: Serialize + Send + 'static,
    S: Service<LambdaEvent<E>, Response = R, Error = Error> + Send + 'static,
    S::Future: Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    // The event as JSON only where a pointer reads it.
    let needs_json =
        matches!(cfg.key, Pick::Path(_)) || matches!(cfg.fingerprint, Some(Pick::Path(_)));
    let json = if needs_json {
        serde_json::to_value(&event.payload)?
    } else {
        serde_json::Value::Null
    };
    let pick = |pick: &Pick<E>| match pick {
        Pick::Fn(f) => f(&event.payload),
        Pick::Path(p) => at_pointer(&json, p),
    };
    let Some(key) = pick(&cfg.key) else {
        return match cfg.missing {
            MissingKey::Run => inner.oneshot(event).await,
            MissingKey::Refuse => Err(format!(
                "the event has no idempotency key for `{}`; nothing ran (fix the event or \
                 the key's path, or choose `MissingKey::Run`)",
                cfg.name
            )
            .into()),
        };
    };
    let fingerprint = match &cfg.fingerprint {
        None => None,
        Some(Pick::Path(p)) => Some(json.pointer(p).cloned().unwrap_or_default()),
        Some(f @ Pick::Fn(_)) => pick(f).map(serde_json::Value::String),
    };
    let op = cfg
        .idem
        .operation(&cfg.name, &key)
        .retain(cfg.retain)
        .lease(lease_until(event.context.deadline, cfg.lease));
    let body = move || async move { inner.oneshot(event).await.map_err(Failed) };
    let out = match fingerprint {
        Some(f) => op.fingerprint(&f).run(body).await,
        None => op.fingerprint_none().run(body).await,
    };
    out.map_err(|Failed(e)| e)
}

type MessageKeyFn = dyn Fn(&SqsMessage) -> Option<String> + Send + Sync;

/// An SQS batch handler with partial batch failures: each record runs idempotently,
/// and the response lists the records that failed (`batchItemFailures`), so SQS
/// redelivers only those; a redelivered record that completed before replays instead of
/// running again. Turn on `ReportBatchItemFailures` on the event source mapping.
///
/// ```no_run
/// use idem_runtime::Idem;
/// use idem_runtime::lambda::SqsBatch;
/// use aws_lambda_events::event::sqs::SqsMessage;
///
/// async fn ship(message: SqsMessage) -> Result<(), lambda_runtime::Error> {
///     Ok(())
/// }
///
/// # async fn run() -> Result<(), lambda_runtime::Error> {
/// let idem = Idem::connect("dynamodb://idem_operations").await?;
/// let handler = SqsBatch::new(idem, "ship")
///     .wrap(tower::service_fn(ship));
/// lambda_runtime::run(handler).await
/// # }
/// ```
pub struct SqsBatch {
    idem: Idem,
    name: String,
    key: Arc<MessageKeyFn>,
    retain: Duration,
    lease: Duration,
    fifo: bool,
}

impl SqsBatch {
    /// Each record an operation `name` on `idem`, keyed by its message id (the same on
    /// every redelivery), retained a day.
    pub fn new(idem: Idem, name: &str) -> Self {
        SqsBatch {
            idem,
            name: name.to_owned(),
            key: Arc::new(|m: &SqsMessage| m.message_id.clone()),
            retain: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(15 * 60),
            fifo: false,
        }
    }

    /// Keys each record by `key` instead of its message id: a business id in its body
    /// or attributes also catches a producer that sent the same intent twice.
    #[must_use]
    pub fn key(
        mut self,
        key: impl Fn(&SqsMessage) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key = Arc::new(key);
        self
    }

    /// How long a record's outcome is kept (default a day).
    #[must_use]
    pub fn retain(mut self, retain: Duration) -> Self {
        self.retain = retain;
        self
    }

    /// A FIFO queue: after the first record that fails, the rest of the batch is
    /// reported failed without running, so their order holds.
    #[must_use]
    pub fn fifo(mut self) -> Self {
        self.fifo = true;
        self
    }

    /// The batch handler around `inner`, which handles one record.
    pub fn wrap<S>(self, inner: S) -> SqsBatchService<S> {
        SqsBatchService {
            cfg: Arc::new(self),
            inner,
        }
    }
}

/// An SQS batch handler made by [`SqsBatch::wrap`].
pub struct SqsBatchService<S> {
    cfg: Arc<SqsBatch>,
    inner: S,
}

impl<S: Clone> Clone for SqsBatchService<S> {
    fn clone(&self) -> Self {
        SqsBatchService {
            cfg: self.cfg.clone(),
            inner: self.inner.clone(),
        }
    }
}

impl<S> Service<LambdaEvent<SqsEvent>> for SqsBatchService<S>
where
    S: Service<SqsMessage, Response = (), Error = Error> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = SqsBatchResponse;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<SqsBatchResponse, Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, event: LambdaEvent<SqsEvent>) -> Self::Future {
        let cfg = self.cfg.clone();
        let inner = self.inner.clone();
        Box::pin(async move {
            let mut response = SqsBatchResponse::default();
            let mut failed = false;
            for message in event.payload.records {
                let id = message.message_id.clone().unwrap_or_default();
                if failed && cfg.fifo {
                    response.batch_item_failures.push(failure(id));
                    continue;
                }
                let outcome =
                    run_record(&cfg, inner.clone(), message, event.context.deadline).await;
                if let Err(e) = outcome {
                    tracing::warn!(message_id = %id, error = %e, "SQS record failed; reported for redelivery");
                    failed = true;
                    response.batch_item_failures.push(failure(id));
                }
            }
            Ok(response)
        })
    }
}

fn failure(message_id: String) -> BatchItemFailure {
    let mut f = BatchItemFailure::default();
    f.item_identifier = message_id;
    f
}

async fn run_record<S>(
    cfg: &SqsBatch,
    inner: S,
    message: SqsMessage,
    deadline: u64,
) -> Result<(), Error>
where
    S: Service<SqsMessage, Response = (), Error = Error> + Send + 'static,
    S::Future: Send + 'static,
{
    let Some(key) = (cfg.key)(&message) else {
        return Err(format!(
            "an SQS record of `{}` has no idempotency key; it was not run",
            cfg.name
        )
        .into());
    };
    cfg.idem
        .operation(&cfg.name, &key)
        .retain(cfg.retain)
        .lease(lease_until(deadline, cfg.lease))
        .fingerprint_none()
        .run(move || async move { inner.oneshot(message).await.map_err(Failed) })
        .await
        .map_err(|Failed(e)| e)
}
