//! One idempotent operation: the builder and the claim → execute → record state machine.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::cache::Cached;
use crate::context;
use crate::error::{IdemError, StoreError};
use crate::fingerprint::FingerprintBuilder;
use crate::idem::Idem;
use crate::key::KeyPart;
use crate::store::{Claim, ClaimRequest, Fence, OperationId, StoredOutcome, Takeover};

/// Longest encoded key or scope, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

const DEFAULT_RETAIN: Duration = Duration::from_secs(24 * 3600);
const DEFAULT_LEASE: Duration = Duration::from_secs(60);
const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// The longest `lease` and in-flight wait accepted: beyond it a value is a mistake (and
/// `Duration::MAX` would overflow clock arithmetic after the claim was written).
pub const MAX_LEASE_OR_WAIT: Duration = Duration::from_secs(366 * 86_400);

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

/// How an operation treats the body's `Err`. Chosen with [`Operation::record_errors`]
/// and [`Operation::classify`]; the default is [`ReleaseErrors`].
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

/// Every `Err` is recorded and replayed like a success.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordErrors;

impl<E: Serialize + DeserializeOwned> ErrorPolicy<E> for RecordErrors {
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
pub struct Classify<F>(F);

impl<E: Serialize + DeserializeOwned, F: Fn(&E) -> Disposition> ErrorPolicy<E> for Classify<F> {
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

/// An upgrade function, set with [`Operation::upgrade`].
#[derive(Clone, Copy, Debug)]
pub struct UpgradeWith<F>(F);

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

/// One idempotent operation being configured; [`run`](Operation::run) executes it.
///
/// Made by [`Idem::operation`]. The key, scope and fingerprint are encoded when they
/// are given, so the builder borrows nothing.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::IdemError> {
/// use std::time::Duration;
/// use idem_runtime::{Idem, IdemError};
///
/// let idem = Idem::memory();
/// let order_id = 42;
/// let receipt = idem
///     .operation("charge", &order_id)
///     .scope("tenant-a")
///     .retain(Duration::from_secs(7 * 86400))
///     .fingerprint(&("tenant-a", order_id, 1999))
///     .run(|| async { Ok::<_, IdemError>(format!("receipt for {order_id}")) })
///     .await?;
/// assert_eq!(receipt, "receipt for 42");
/// # Ok(()) }
/// ```
#[must_use = "an operation does nothing until `run` is awaited"]
pub struct Operation<P = ReleaseErrors, U = NoUpgrade> {
    idem: Option<Idem>,
    id: OperationId,
    invalid: Option<IdemError>,
    fingerprint: FingerprintBuilder,
    retain: Duration,
    lease: Duration,
    in_flight: InFlight,
    on_takeover: Takeover,
    on_store_error: OnStoreError,
    version: u32,
    policy: P,
    upgrade: U,
}

impl Operation {
    pub(crate) fn new<K: KeyPart + ?Sized>(idem: Option<Idem>, name: &str, key: &K) -> Self {
        let mut op = Operation {
            idem,
            id: OperationId {
                scope: String::new(),
                name: name.to_owned(),
                key: String::new(),
            },
            invalid: None,
            fingerprint: FingerprintBuilder::default(),
            retain: DEFAULT_RETAIN,
            lease: DEFAULT_LEASE,
            in_flight: InFlight::default(),
            on_takeover: Takeover::Rerun,
            on_store_error: OnStoreError::FailClosed,
            version: 1,
            policy: ReleaseErrors,
            upgrade: NoUpgrade,
        };
        if name.is_empty() || name.len() > MAX_KEY_BYTES {
            op.fail(IdemError::BadName {
                name: name.to_owned(),
                max: MAX_KEY_BYTES,
            });
        }
        let key = key.encode_key();
        if key.len() > MAX_KEY_BYTES {
            op.fail(IdemError::KeyTooLong {
                name: name.to_owned(),
                len: key.len(),
                max: MAX_KEY_BYTES,
            });
        }
        op.id.key = match &op.idem {
            Some(idem) => idem.stored_key(key),
            None => key,
        };
        op
    }
}

impl<P, U> Operation<P, U> {
    fn fail(&mut self, e: IdemError) {
        self.invalid.get_or_insert(e);
    }

    /// The namespace: a tenant, account or principal. The same key in two scopes is
    /// two operations. Default: the empty scope.
    pub fn scope<S: KeyPart + ?Sized>(mut self, scope: &S) -> Self {
        let scope = scope.encode_key();
        if scope.len() > MAX_KEY_BYTES {
            self.fail(IdemError::ScopeTooLong {
                name: self.id.name.clone(),
                len: scope.len(),
                max: MAX_KEY_BYTES,
            });
        }
        self.id.scope = match &self.idem {
            Some(idem) => idem.stored_key(scope),
            None => scope,
        };
        self
    }

    /// How long a completed outcome is kept and replayed. Size it from the longest
    /// retry or redelivery horizon of the callers. Default: 24 hours.
    pub fn retain(mut self, retain: Duration) -> Self {
        if retain.is_zero() {
            self.fail(IdemError::Config {
                message: "`retain` must be more than zero; size it from the longest retry horizon"
                    .into(),
            });
        }
        self.retain = retain;
        self
    }

    /// How long a claim is owned before another caller may take it over. Renewed
    /// while the body runs. Default: 60 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        if lease < Duration::from_millis(1) {
            self.fail(IdemError::Config {
                message: "`lease` must be at least 1ms".into(),
            });
        }
        if lease > MAX_LEASE_OR_WAIT {
            self.fail(IdemError::Config {
                message: format!(
                    "`lease` of {lease:?} is over the limit of 366 days; size it from the \
                     longest time a live body may run between renewals (60s is the default)"
                ),
            });
        }
        self.lease = lease;
        self
    }

    /// What a duplicate does while the first call runs. Default: wait up to 5 seconds.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        if let InFlight::Wait(d) = in_flight
            && d > MAX_LEASE_OR_WAIT
        {
            self.fail(IdemError::Config {
                message: format!(
                    "`in_flight = wait({d:?})` is over the limit of 366 days; wait a few \
                     seconds and let the caller retry on `InFlight`"
                ),
            });
        }
        self.in_flight = in_flight;
        self
    }

    /// What a lapsed claim turns into. Default: [`Takeover::Rerun`].
    pub fn on_takeover(mut self, on_takeover: Takeover) -> Self {
        self.on_takeover = on_takeover;
        self
    }

    /// What happens when the store is unreachable at claim time. Default:
    /// [`OnStoreError::FailClosed`].
    pub fn on_store_error(mut self, on_store_error: OnStoreError) -> Self {
        self.on_store_error = on_store_error;
        self
    }

    /// Binds `value` to the key: a later call with the same key and a different value
    /// is refused with [`IdemError::Mismatch`]. May be called more than once.
    pub fn fingerprint<F: Serialize + ?Sized>(self, value: &F) -> Self {
        self.fingerprint_part("", value)
    }

    /// Like [`fingerprint`](Self::fingerprint), naming the part (the attribute passes
    /// each parameter by name).
    pub fn fingerprint_part<F: Serialize + ?Sized>(mut self, part: &str, value: &F) -> Self {
        if let Err(message) = self.fingerprint.add(part, value) {
            let name = self.id.name.clone();
            self.fail(IdemError::Codec {
                name,
                message: format!("cannot fingerprint `{part}`: {message}"),
            });
        }
        self
    }

    /// The outcome's schema version (default 1). Bump it when `T` changes shape.
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Records every `Err` and replays it like a success (`errors = record`).
    pub fn record_errors(self) -> Operation<RecordErrors, U> {
        self.with_policy(RecordErrors)
    }

    /// Decides per error with `classify` (`classify = path`).
    pub fn classify<F>(self, classify: F) -> Operation<Classify<F>, U> {
        self.with_policy(Classify(classify))
    }

    /// Converts outcomes recorded under another [`version`](Self::version).
    pub fn upgrade<F>(self, upgrade: F) -> Operation<P, UpgradeWith<F>> {
        Operation {
            idem: self.idem,
            id: self.id,
            invalid: self.invalid,
            fingerprint: self.fingerprint,
            retain: self.retain,
            lease: self.lease,
            in_flight: self.in_flight,
            on_takeover: self.on_takeover,
            on_store_error: self.on_store_error,
            version: self.version,
            policy: self.policy,
            upgrade: UpgradeWith(upgrade),
        }
    }

    fn with_policy<Q>(self, policy: Q) -> Operation<Q, U> {
        Operation {
            idem: self.idem,
            id: self.id,
            invalid: self.invalid,
            fingerprint: self.fingerprint,
            retain: self.retain,
            lease: self.lease,
            in_flight: self.in_flight,
            on_takeover: self.on_takeover,
            on_store_error: self.on_store_error,
            version: self.version,
            policy,
            upgrade: self.upgrade,
        }
    }

    /// The operation's identity as stored, for matching [`Idem::list`] rows and for
    /// [`Idem::resolve`].
    pub fn id(&self) -> &OperationId {
        &self.id
    }

    pub(crate) fn decode_outcome<T, E>(&self, outcome: &StoredOutcome) -> Result<T, E>
    where
        T: DeserializeOwned,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
        U: Upgrade<T>,
    {
        let codec = |message: String| IdemError::Codec {
            name: self.id.name.as_str().to_owned(),
            message,
        };
        if outcome.is_err {
            if outcome.version != self.version {
                return Err(codec(format!(
                    "a recorded error has schema version {} but this build expects version {}; \
                     resolve the operation or wait for it to expire",
                    outcome.version, self.version
                ))
                .into());
            }
            return match self.policy.decode(&outcome.body) {
                Ok(e) => Err(e),
                Err(m) => Err(codec(format!("cannot decode the recorded error: {m}")).into()),
            };
        }
        if outcome.version != self.version {
            let value: serde_json::Value = serde_json::from_slice(&outcome.body)
                .map_err(|e| codec(format!("the recorded outcome is not JSON: {e}")))?;
            return Ok(self.upgrade.upgrade(
                self.id.name.as_str(),
                outcome.version,
                self.version,
                value,
            )?);
        }
        serde_json::from_slice(&outcome.body).map_err(|e| {
            codec(format!(
                "cannot decode the recorded outcome as this build's type: {e}; if the type \
                 changed shape, bump `version` and add `upgrade`"
            ))
            .into()
        })
    }

    /// The first error the builder met (an oversized key, a failed fingerprint).
    pub(crate) fn take_invalid(&mut self) -> Result<(), IdemError> {
        self.invalid.take().map_or(Ok(()), Err)
    }

    pub(crate) fn idem_handle(&self) -> Result<Idem, IdemError> {
        self.idem.clone().ok_or(IdemError::NoStore)
    }

    pub(crate) fn fingerprint_bytes(&self) -> [u8; 32] {
        self.fingerprint.finish()
    }

    /// Claims the operation, runs `body` if this call owns it, and records the outcome.
    ///
    /// A completed duplicate gets the recorded outcome without running `body`. See the
    /// crate docs for every other case.
    pub async fn run<F, Fut, T, E>(self, body: F) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
        U: Upgrade<T>,
    {
        let mut this = self;
        this.take_invalid()?;
        let run = Run {
            idem: this.idem_handle()?,
            op: &this,
            fingerprint: this.fingerprint_bytes(),
            _t: PhantomData,
        };
        run.go(body).await
    }
}

/// What transactional mode reads of an operation.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl<P, U> Operation<P, U> {
    pub(crate) fn policy(&self) -> &P {
        &self.policy
    }

    pub(crate) fn version_number(&self) -> u32 {
        self.version
    }

    pub(crate) fn retain_for(&self) -> Duration {
        self.retain
    }

    pub(crate) fn lease_for(&self) -> Duration {
        self.lease
    }
}

struct Run<'a, P, U, T> {
    idem: Idem,
    op: &'a Operation<P, U>,
    fingerprint: [u8; 32],
    _t: PhantomData<fn() -> T>,
}

enum Decided {
    /// Run the body at this epoch; the claim was sent at that instant.
    Execute(u64, Instant),
    Replay(Arc<StoredOutcome>),
    Unprotected,
}

impl<P, U, T> Run<'_, P, U, T>
where
    T: Serialize + DeserializeOwned,
    U: Upgrade<T>,
{
    fn name(&self) -> &str {
        &self.op.id.name
    }

    async fn go<F, Fut, E>(self, body: F) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
    {
        use tracing::Instrument;
        let id = &self.op.id;
        // Every event of the call (claim, replay, mismatch, wait, takeover, fence,
        // unknown), the renewal task's and the body's own carry scope, name and key.
        let span = tracing::info_span!(
            "idem",
            scope = %self.idem.log_key(&id.scope),
            name = %id.name,
            key = %self.idem.log_key(&id.key),
        );
        async {
            let span = tracing::Span::current();
            match self.decide().await? {
                Decided::Replay(outcome) => {
                    tracing::debug!("replay");
                    // A recorded `Err` replayed is a replay too (the HTTP layer marks it).
                    context::report_replay();
                    self.op.decode_outcome(&outcome)
                }
                Decided::Unprotected => {
                    tracing::warn!("store unreachable; running the body unprotected (fail_open)");
                    context::scope_body(id, 0, body()).await
                }
                Decided::Execute(epoch, sent) => self.execute(epoch, sent, body, &span).await,
            }
        }
        .instrument(span)
        .await
    }

    /// Claims, waiting on an in-flight duplicate as configured, until the operation is
    /// ours, replayable, or refused.
    async fn decide(&self) -> Result<Decided, IdemError> {
        let id = &self.op.id;
        let store = self.idem.store();
        // Completed outcomes are immutable until they expire, so a read decides a
        // replay without taking the write path: first this process's own, then the store.
        match self.idem.cache().get(id, &self.fingerprint) {
            Some(Cached::Replay(outcome)) => return Ok(Decided::Replay(outcome)),
            Some(Cached::Mismatch) => return Err(self.mismatch()),
            None => {}
        }
        match store.peek_completed(id, &self.fingerprint).await {
            Ok(Some(Ok(outcome))) => return Ok(Decided::Replay(Arc::new(outcome))),
            Ok(Some(Err(_))) => return Err(self.mismatch()),
            Ok(None) => {}
            Err(e) => return self.store_down(e),
        }
        let req = ClaimRequest {
            id,
            fingerprint: self.fingerprint,
            lease: self.op.lease,
            on_takeover: self.op.on_takeover,
        };
        let deadline = match self.op.in_flight {
            InFlight::Wait(d) => Some(Instant::now() + d),
            InFlight::Reject => None,
        };
        let mut waiter = None;
        loop {
            let notified = waiter
                .as_ref()
                .map(|w: &crate::wake::Waiter| w.notify.clone());
            let notified = notified.as_deref().map(|n| n.notified());
            tokio::pin!(notified);
            if let Some(n) = notified.as_mut().as_pin_mut() {
                // Registered before the claim, so a wake between the claim and the
                // sleep is not lost.
                n.enable();
            }
            let sent = Instant::now();
            let claim = match store.claim(&req).await {
                Ok(c) => c,
                // Another caller is known to be running it: running it here too, even
                // with `fail_open`, would be the duplicate idem exists to prevent. A
                // transient error is waited out like the in-flight call, to the deadline.
                Err(e) if waiter.is_some() => {
                    let now = Instant::now();
                    match deadline {
                        Some(deadline) if e.retryable && now < deadline => {
                            tracing::debug!(error = %e, "claim failed while waiting; retrying");
                            let nap = self.idem.poll_interval().min(deadline - now);
                            tokio::time::sleep(nap).await;
                            continue;
                        }
                        _ => return Err(IdemError::store("claim", e)),
                    }
                }
                Err(e) => return self.store_down(e),
            };
            match claim {
                Claim::Acquired { epoch, takeover } => {
                    if takeover {
                        tracing::info!(epoch, "takeover of a lapsed claim");
                    } else {
                        tracing::debug!(epoch, "claimed");
                    }
                    return Ok(Decided::Execute(epoch, sent));
                }
                Claim::Completed(outcome) => return Ok(Decided::Replay(Arc::new(outcome))),
                Claim::Mismatch => return Err(self.mismatch()),
                Claim::Unknown { epoch, now } => {
                    if now {
                        tracing::warn!(
                            epoch,
                            "lapsed claim moved to UNKNOWN (on_takeover = unknown)"
                        );
                        self.idem.wake(id);
                    }
                    return Err(IdemError::Unknown {
                        name: self.name().to_owned(),
                        epoch,
                    });
                }
                Claim::InFlight { retry_after } => {
                    let in_flight = || IdemError::InFlight {
                        name: self.name().to_owned(),
                        retry_after,
                    };
                    let Some(deadline) = deadline else {
                        return Err(in_flight());
                    };
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(in_flight());
                    }
                    if waiter.is_none() {
                        match self.idem.register_waiter(id) {
                            Some(w) => waiter = Some(w),
                            None => {
                                return Err(IdemError::TooManyWaiters {
                                    name: self.name().to_owned(),
                                    retry_after,
                                });
                            }
                        }
                        tracing::debug!(?retry_after, "waiting on in-flight duplicate");
                        if let Err(e) = store.announce_wait(id).await {
                            tracing::debug!(error = %e, "could not announce the wait; polling");
                        }
                        // Re-claim at once: the first call may have finished meanwhile.
                        continue;
                    }
                    // Wake on completion or release, at the lease's end (to take over),
                    // and at the poll interval for changes made by other processes.
                    let nap = (retry_after + Duration::from_millis(1))
                        .min(self.idem.poll_interval())
                        .min(deadline - now);
                    if let Some(n) = notified.as_pin_mut() {
                        let _ = tokio::time::timeout(nap, n).await;
                    }
                }
            }
        }
    }

    fn mismatch(&self) -> IdemError {
        tracing::info!("fingerprint mismatch");
        IdemError::Mismatch {
            name: self.name().to_owned(),
        }
    }

    fn store_down(&self, e: StoreError) -> Result<Decided, IdemError> {
        match self.op.on_store_error {
            // Only an unreachable store: a refusal, a constraint or contention means the
            // store is up and answered, so running unprotected could duplicate a call.
            OnStoreError::FailOpen if e.unreachable => {
                tracing::warn!(error = %e, "idem store unreachable at claim");
                Ok(Decided::Unprotected)
            }
            _ => Err(IdemError::store("claim", e)),
        }
    }

    async fn execute<F, Fut, E>(
        self,
        epoch: u64,
        claimed_at: Instant,
        body: F,
        span: &tracing::Span,
    ) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
    {
        let id = &self.op.id;
        // Renewed until the outcome is settled, so a record retried after a slow body
        // still has the lease the renewals kept alive.
        let lease = self.idem.hold_lease(id, epoch, self.op.lease, claimed_at);
        let out = context::scope_body(id, epoch, body()).await;
        let lease_end = &lease;

        let (outcome, result) = match out {
            Ok(v) => match serde_json::to_vec(&v) {
                Ok(body) => (
                    StoredOutcome {
                        is_err: false,
                        version: self.op.version,
                        body,
                    },
                    Ok(v),
                ),
                Err(e) => {
                    // The body ran; a release would run it again, so park it in UNKNOWN.
                    let now = self.settle_unknown(epoch, lease_end).await;
                    return Err(IdemError::Codec {
                        name: self.name().to_owned(),
                        message: format!(
                            "the body ran but its outcome cannot be serialized ({e}); {now}"
                        ),
                    }
                    .into());
                }
            },
            Err(err) => match self.op.policy.disposition(&err) {
                Disposition::Release => {
                    match self.idem.store().release(id, epoch).await {
                        Ok(Fence::Held) => {
                            tracing::debug!(parent: span, epoch, "released after error")
                        }
                        Ok(Fence::Lost) => {
                            tracing::warn!(parent: span, epoch, "fenced: claim lost before release")
                        }
                        // The lease will lapse and a retry takes over: the contract allows
                        // a released error to run again.
                        Err(e) => tracing::warn!(parent: span, epoch, error = %e, "release failed"),
                    }
                    self.idem.wake(id);
                    context::report_run(epoch);
                    return Err(err);
                }
                Disposition::Unknown => {
                    self.settle_unknown(epoch, lease_end).await;
                    context::report_run(epoch);
                    return Err(err);
                }
                Disposition::Record => match self.op.policy.encode(&err) {
                    Ok(body) => (
                        StoredOutcome {
                            is_err: true,
                            version: self.op.version,
                            body,
                        },
                        Err(err),
                    ),
                    Err(m) => {
                        let now = self.settle_unknown(epoch, lease_end).await;
                        return Err(IdemError::Codec {
                            name: self.name().to_owned(),
                            message: format!(
                                "the body's error cannot be serialized for recording ({m}); {now}"
                            ),
                        }
                        .into());
                    }
                },
            },
        };

        let max = self.idem.max_outcome_bytes();
        if outcome.body.len() > max {
            self.settle_unknown(epoch, lease_end).await;
            return Err(IdemError::OutcomeTooLarge {
                name: self.name().to_owned(),
                len: outcome.body.len(),
                max,
            }
            .into());
        }
        self.record(epoch, &outcome, lease_end, span).await?;
        context::report_run(epoch);
        result
    }

    /// Records, retrying a retryable store error while the lease may still hold, for at
    /// most one lease: from the first attempt, or from the last renewal the store
    /// confirmed if that is earlier (renewals keep running meanwhile). The store extends
    /// a lease from its own clock when the statement runs, which may be well after it was
    /// sent, so the lease this process can prove is shorter than the real one; every
    /// attempt is fenced, so one that lands after a takeover changes nothing and reports
    /// `Fenced`.
    async fn record(
        &self,
        epoch: u64,
        outcome: &StoredOutcome,
        lease: &crate::idem::Lease,
        span: &tracing::Span,
    ) -> Result<(), IdemError> {
        let id = &self.op.id;
        let mut backoff = Duration::from_millis(20);
        // Before the first attempt, so the store's expiry is no earlier than this + retain.
        // The cache keeps time by the standard clock, like its reads.
        let sent_at = std::time::Instant::now();
        let started = Instant::now();
        loop {
            match self
                .idem
                .store()
                .record(id, epoch, outcome, self.op.retain)
                .await
            {
                Ok(Fence::Held) => {
                    self.idem
                        .cache()
                        .put(id, self.fingerprint, outcome, sent_at, self.op.retain);
                    tracing::debug!(parent: span, epoch, "recorded");
                    self.idem.wake(id);
                    return Ok(());
                }
                Ok(Fence::Lost) => {
                    tracing::warn!(parent: span, epoch, "fenced: lease lapsed and another caller took over");
                    return Err(IdemError::Fenced {
                        name: self.name().to_owned(),
                        epoch,
                    });
                }
                Err(e) => {
                    let now = Instant::now();
                    let Some(held_until) = lease.held_until() else {
                        // A renewal found the claim gone: this record can only be fenced.
                        tracing::warn!(parent: span, epoch, "fenced: the claim was taken over or resolved");
                        return Err(IdemError::Fenced {
                            name: self.name().to_owned(),
                            epoch,
                        });
                    };
                    if !e.retryable || now + backoff >= started.min(held_until) + self.op.lease {
                        tracing::error!(parent: span, epoch, error = %e, "outcome unrecorded");
                        return Err(IdemError::Unrecorded {
                            name: self.name().to_owned(),
                            epoch,
                            source: e.source,
                        });
                    }
                    tracing::warn!(parent: span, epoch, error = %e, "record failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    /// Moves the claim to UNKNOWN, retrying while the lease holds; if that fails too the
    /// claim stays IN_PROGRESS and its lease lapses, which `on_takeover` then governs.
    /// Returns what became of the operation, for the caller's error message.
    async fn settle_unknown(&self, epoch: u64, lease: &crate::idem::Lease) -> &'static str {
        let id = &self.op.id;
        loop {
            match self.idem.store().mark_unknown(id, epoch).await {
                Ok(Fence::Held) => {
                    tracing::warn!(epoch, "operation moved to UNKNOWN");
                    self.idem.wake(id);
                    return "the operation is now UNKNOWN; resolve it once you know whether the \
                            effect happened";
                }
                Ok(Fence::Lost) => {
                    tracing::warn!(
                        epoch,
                        "fenced: another claim owns the operation; not marked UNKNOWN"
                    );
                    return "another claim took the operation over after this one's lease lapsed, \
                            so it was not marked UNKNOWN";
                }
                Err(e)
                    if lease
                        .held_until()
                        .is_some_and(|t| Instant::now() + Duration::from_millis(50) < t) =>
                {
                    tracing::warn!(epoch, error = %e, "could not mark UNKNOWN; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::error!(epoch, error = %e, "could not mark UNKNOWN");
                    return "it could not be marked UNKNOWN (the store failed), so it stays in \
                            progress until its lease lapses and `on_takeover` applies";
                }
            }
        }
    }
}
