//! One idempotent operation: its identity, the builder that states it (`Idem::operation`
//! and the `Operation` methods that set its options), and how its outcome is encoded
//! for the store and decoded from it. `machine.rs` runs it (`run`), `tx.rs` runs it
//! inside the caller's transaction (`begin_tx`).

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::IdemError;
use crate::fingerprint::FingerprintBuilder;
use crate::idem::Idem;
use crate::key::KeyPart;
use crate::store::{OperationId, OutcomeRef, StoredOutcome, Takeover};

/// Longest encoded key or scope, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

const DEFAULT_LEASE: Duration = Duration::from_secs(60);
const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// The longest `lease` and in-flight wait accepted: beyond it a value is a mistake (and
/// `Duration::MAX` would overflow clock arithmetic after the claim was written).
pub const MAX_LEASE_OR_WAIT: Duration = Duration::from_secs(366 * 86_400);

/// An operation's identity, shared once the call runs. When the operation ends with it
/// unshared, its strings are cleared and it is kept on this thread for the next
/// operation, which fills them in the room they kept: an identity costs four
/// allocations (the `Arc` and three strings) only on a thread's first calls.
pub(crate) struct Id(Option<Arc<OperationId>>);

thread_local! {
    static SPARE_IDS: std::cell::RefCell<Vec<Arc<OperationId>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Spare identities a thread keeps; enough for the calls one task starts at once.
const SPARE_IDS_KEPT: usize = 16;
/// An identity whose strings hold more room than this is freed rather than kept.
const SPARE_ID_ROOM: usize = 1024;

impl Id {
    /// A spare identity of this thread's, or a new one; its strings empty.
    fn spare() -> Id {
        let spare = SPARE_IDS
            .try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop()))
            .ok()
            .flatten();
        Id(Some(spare.unwrap_or_default()))
    }

    fn arc(&self) -> &Arc<OperationId> {
        self.0
            .as_ref()
            .expect("an identity is taken only when dropped")
    }

    /// The shared identity, borrowed.
    pub(crate) fn arc_ref(&self) -> &Arc<OperationId> {
        self.arc()
    }

    /// The identity shared, for the body's context and the lease.
    pub(crate) fn shared(&self) -> Arc<OperationId> {
        self.arc().clone()
    }

    /// Written only while the builder runs, when it is not shared: no copy is made.
    fn get_mut(&mut self) -> &mut OperationId {
        Arc::make_mut(
            self.0
                .as_mut()
                .expect("an identity is taken only when dropped"),
        )
    }
}

impl std::ops::Deref for Id {
    type Target = OperationId;
    fn deref(&self) -> &OperationId {
        self.arc()
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        let Some(mut arc) = self.0.take() else {
            return;
        };
        // Still held by a body's context or a renewal: it is theirs to free.
        let Some(id) = Arc::get_mut(&mut arc) else {
            return;
        };
        if id.scope.capacity() + id.name.capacity() + id.key.capacity() > SPARE_ID_ROOM {
            return;
        }
        id.scope.clear();
        id.name.clear();
        id.key.clear();
        // Not while the thread's storage is being torn down, nor from within a borrow.
        let _ = SPARE_IDS.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && s.len() < SPARE_IDS_KEPT
            {
                s.push(arc);
            }
        });
    }
}

/// Writes `part` into `out` as it is stored (keyed-hashed where `idem` asks for it), in
/// place of what `out` held; returns the encoding's length before hashing, which is
/// what the limits apply to.
fn write_stored<K: KeyPart + ?Sized>(idem: Option<&Idem>, part: &K, out: &mut String) -> usize {
    out.clear();
    part.write_key(out);
    let len = out.len();
    if let Some(idem) = idem {
        idem.store_key(out);
    }
    len
}

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

/// An `Ok` type that [`Operation::run`] can record and replay: every
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
pub struct Classify<F>(F);

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
///
/// # Nesting
///
/// An idempotent call made inside another's body (an `#[idempotent]` function calling
/// another, or a `run` inside a `run`) is an operation of its own: its own claim,
/// record and retention, its own [`current()`](crate::current) while its body runs, and
/// its own [`observe`](crate::observe) report (the outer call's report stays the outer
/// call's).
///
/// Without `tx`, the inner operation is recorded in the store when the inner call
/// returns, whatever then becomes of the outer one. When the outer body's error is
/// released, or the outer claim is taken over, and the outer body runs again, the inner
/// call (with the same key and fingerprint) replays its recorded outcome rather than
/// running again:
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
/// use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
/// # #[derive(Debug)]
/// # enum ShipError { CarrierDown, Idem(IdemError) }
/// # impl From<IdemError> for ShipError {
/// #     fn from(e: IdemError) -> Self { ShipError::Idem(e) }
/// # }
/// static LABELS: AtomicU32 = AtomicU32::new(0);
///
/// #[idempotent(store = idem, key = order, retain = "1d")]
/// async fn print_label(idem: &Idem, order: u64) -> Result<u32, IdemError> {
///     Ok(LABELS.fetch_add(1, SeqCst) + 1)
/// }
///
/// #[idempotent(store = idem, key = order, retain = "1d")]
/// async fn ship_parcel(idem: &Idem, order: u64, #[idem(skip)] down: bool) -> Result<u32, ShipError> {
///     let label = print_label(idem, order).await?; // recorded on its own
///     if down { return Err(ShipError::CarrierDown); } // released: `ship_parcel` runs again
///     Ok(label)
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), ShipError> {
/// let idem = Idem::memory();
/// assert!(matches!(ship_parcel(&idem, 7, true).await, Err(ShipError::CarrierDown)));
/// assert_eq!(ship_parcel(&idem, 7, false).await?, 1); // the label was printed once
/// # assert_eq!(LABELS.load(SeqCst), 1);
/// # Ok(()) }
/// ```
///
/// In transactional mode (`tx`), an inner call given the same transaction claims and
/// records in it, under savepoints of its own: its released `Err` rolls back its own
/// writes and claim only, and its record commits or rolls back with the transaction. An
/// outer released `Err` rolls back to the outer operation's savepoint, which undoes the
/// inner call's writes and record too, so the retry runs both bodies again. A call
/// without `tx` inside a transactional body records in the store as above, outside the
/// transaction: a rollback does not undo it. See
/// [`guide::transactions`](crate::guide::transactions).
///
/// A call with the running operation's own identity (the same scope, name and key) is a
/// duplicate of it, not a nested operation: it waits as `in_flight` says and then fails
/// with [`IdemError::InFlight`] (in transactional mode, at once), since the outer claim
/// is held until the outer body returns. Give the inner call a name or key of its own.
///
/// ```
/// # use idem_runtime::{Idem, IdemError, InFlight};
/// # use std::time::Duration;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let idem = Idem::memory();
/// let sync = || idem.operation("sync", "s-1").retain(Duration::from_secs(60));
/// let r = sync().fingerprint_none().run(|| async {
///     let inner = sync().in_flight(InFlight::Reject).fingerprint_none();
///     inner.run(|| async { Ok::<_, IdemError>(1) }).await
/// });
/// assert!(matches!(r.await, Err(IdemError::InFlight { .. })));
/// # }
/// ```
#[must_use = "an operation does nothing until `run` is awaited"]
pub struct Operation<P = ReleaseErrors, U = NoUpgrade, F = Stated, R = Stated> {
    pub(crate) idem: Option<Idem>,
    /// Shared, once running, with the body's context and the lease's renewals.
    pub(crate) id: Id,
    /// Boxed: rare, and every call's future holds and moves the operation.
    pub(crate) invalid: Option<Box<IdemError>>,
    pub(crate) fingerprint: FingerprintBuilder,
    pub(crate) retain: Duration,
    pub(crate) lease: Duration,
    pub(crate) in_flight: InFlight,
    pub(crate) on_takeover: Takeover,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) version: u32,
    pub(crate) policy: P,
    pub(crate) upgrade: U,
    /// Whether the fingerprint (`F`) and the retention (`R`) were stated.
    stated: PhantomData<fn() -> (F, R)>,
}

/// An operation as [`Idem::operation`] starts it: its fingerprint and its retention
/// are still to be stated before [`run`](Operation::run).
pub type NewOperation = Operation<ReleaseErrors, NoUpgrade, Unstated, Unstated>;

/// A part of an operation's configuration that has not been stated yet (a type state of
/// [`Operation`]).
#[derive(Debug)]
pub enum Unstated {}

/// A part of an operation's configuration that has been stated (a type state of
/// [`Operation`]).
#[derive(Debug)]
pub enum Stated {}

/// Implemented by [`Stated`] only: an operation runs once its fingerprint is stated.
#[diagnostic::on_unimplemented(
    message = "the operation's fingerprint is not stated",
    label = "`run` needs the fingerprint stated first",
    note = "call `.fingerprint(&request)` with what the key is bound to, or \
            `.fingerprint_none()` where the key alone is the whole request"
)]
pub trait FingerprintStated: sealed::Sealed {}
impl FingerprintStated for Stated {}

/// Implemented by [`Stated`] only: an operation runs once its retention is stated.
#[diagnostic::on_unimplemented(
    message = "the operation's retention is not stated",
    label = "`run` needs the retention stated first",
    note = "call `.retain(duration)`, sized from the longest retry or redelivery horizon of \
            the callers"
)]
pub trait RetentionStated: sealed::Sealed {}
impl RetentionStated for Stated {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Stated {}
}

impl NewOperation {
    pub(crate) fn new<K: KeyPart + ?Sized>(idem: Option<Idem>, name: &str, key: &K) -> Self {
        let mut id = Id::spare();
        let own = id.get_mut();
        own.name.push_str(name);
        let key_len = write_stored(idem.as_ref(), key, &mut own.key);
        let mut op = Operation {
            idem,
            id,
            invalid: None,
            fingerprint: FingerprintBuilder::default(),
            // Stated before the operation can run.
            retain: Duration::ZERO,
            lease: DEFAULT_LEASE,
            in_flight: InFlight::default(),
            on_takeover: Takeover::Rerun,
            on_store_error: OnStoreError::FailClosed,
            version: 1,
            policy: ReleaseErrors,
            upgrade: NoUpgrade,
            stated: PhantomData,
        };
        if name.is_empty() || name.len() > MAX_KEY_BYTES {
            op.fail(IdemError::BadName {
                name: name.to_owned(),
                max: MAX_KEY_BYTES,
            });
        }
        if key.is_empty_key() {
            op.fail(IdemError::EmptyKey {
                name: name.to_owned(),
            });
        }
        if key_len > MAX_KEY_BYTES {
            op.fail(IdemError::KeyTooLong {
                name: name.to_owned(),
                len: key_len,
                max: MAX_KEY_BYTES,
            });
        }
        op
    }
}

impl<P, U, F, R> Operation<P, U, F, R> {
    fn fail(&mut self, e: IdemError) {
        self.invalid.get_or_insert_with(|| Box::new(e));
    }

    /// The namespace: a tenant, account or principal. The same key in two scopes is
    /// two operations. Default: the empty scope.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let charge = |tenant: &'static str| {
    ///     idem.operation("charge", "order-1")
    ///         .scope(tenant)
    ///         .retain(Duration::from_secs(3600))
    ///         .fingerprint_none()
    ///         .run(move || async move { Ok::<_, IdemError>(tenant.to_owned()) })
    /// };
    /// assert_eq!(charge("acme").await?, "acme");
    /// assert_eq!(charge("globex").await?, "globex"); // another scope: another operation
    /// # Ok(()) }
    /// ```
    pub fn scope<S: KeyPart + ?Sized>(mut self, scope: &S) -> Self {
        let len = write_stored(self.idem.as_ref(), scope, &mut self.id.get_mut().scope);
        if len > MAX_KEY_BYTES {
            self.fail(IdemError::ScopeTooLong {
                name: self.id.name.clone(),
                len,
                max: MAX_KEY_BYTES,
            });
        }
        self
    }

    /// How long a completed outcome is kept and replayed. Size it from the longest
    /// retry or redelivery horizon of the callers. Required: an operation runs only
    /// once its retention is stated, as the attribute's `retain` is.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let sent = idem
    ///     .operation("send_invoice", "inv-7")
    ///     .retain(Duration::from_secs(7 * 86_400)) // clients retry for up to a week
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>(true) })
    ///     .await?;
    /// # assert!(sent);
    /// # Ok(()) }
    /// ```
    pub fn retain(mut self, retain: Duration) -> Operation<P, U, F, Stated> {
        if retain.is_zero() {
            self.fail(IdemError::Config {
                message: "`retain` must be more than zero; size it from the longest retry horizon"
                    .into(),
            });
        }
        self.retain = retain;
        self.restate()
    }

    /// How long a claim is owned before another caller may take it over. Renewed
    /// while the body runs. Default: 60 seconds.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let rows = idem
    ///     .operation("export", "2024-q3")
    ///     .retain(Duration::from_secs(86_400))
    ///     .lease(Duration::from_secs(300)) // a crashed export is taken over after 5 minutes
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>(1200) })
    ///     .await?;
    /// # assert_eq!(rows, 1200);
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, InFlight};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let export = || {
    ///     idem.operation("export", "e-1")
    ///         .retain(Duration::from_secs(60))
    ///         .in_flight(InFlight::Reject)
    ///         .fingerprint_none()
    ///         .run(|| async {
    ///             tokio::time::sleep(Duration::from_millis(10)).await;
    ///             Ok::<_, IdemError>(1)
    ///         })
    /// };
    /// let (first, duplicate) = tokio::join!(export(), export());
    /// assert_eq!(first?, 1);
    /// assert!(matches!(duplicate, Err(IdemError::InFlight { .. })));
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, Takeover};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let sent = idem
    ///     .operation("welcome_email", "user-7")
    ///     .retain(Duration::from_secs(86_400))
    ///     // The mail provider takes no idempotency key: after a crash, ask an operator.
    ///     .on_takeover(Takeover::Unknown)
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>(true) })
    ///     .await?;
    /// # assert!(sent);
    /// # Ok(()) }
    /// ```
    pub fn on_takeover(mut self, on_takeover: Takeover) -> Self {
        self.on_takeover = on_takeover;
        self
    }

    /// What happens when the store is unreachable at claim time. Default:
    /// [`OnStoreError::FailClosed`].
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, OnStoreError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let pushed = idem
    ///     .operation("push_notification", "n-42")
    ///     .retain(Duration::from_secs(3600))
    ///     .on_store_error(OnStoreError::FailOpen) // a duplicate push beats no push
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>(true) })
    ///     .await?;
    /// # assert!(pushed);
    /// # Ok(()) }
    /// ```
    pub fn on_store_error(mut self, on_store_error: OnStoreError) -> Self {
        self.on_store_error = on_store_error;
        self
    }

    /// Binds `value` to the key: a later call with the same key and a different value
    /// is refused with [`IdemError::Mismatch`]. May be called more than once. An
    /// operation runs only once its fingerprint is stated, with this or
    /// [`fingerprint_none`](Self::fingerprint_none).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let pay = |cents: u64| {
    ///     idem.operation("pay", "order-1")
    ///         .retain(Duration::from_secs(3600))
    ///         .fingerprint(&cents)
    ///         .run(move || async move { Ok::<_, IdemError>(cents) })
    /// };
    /// assert_eq!(pay(500).await?, 500);
    /// assert!(matches!(pay(900).await, Err(IdemError::Mismatch { .. })));
    /// # Ok(()) }
    /// ```
    pub fn fingerprint<V: Serialize + ?Sized>(self, value: &V) -> Operation<P, U, Stated, R> {
        self.fingerprint_part("", value)
    }

    /// Binds nothing to the key: any call with the same key is the same request. For
    /// operations whose key alone is the whole request (a message id, a webhook event
    /// id); where the payload can differ, use [`fingerprint`](Self::fingerprint).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let ingest = |body: &'static str| {
    ///     idem.operation("ingest", "event-1")
    ///         .retain(Duration::from_secs(3600))
    ///         .fingerprint_none()
    ///         .run(move || async move { Ok::<_, IdemError>(body.to_owned()) })
    /// };
    /// assert_eq!(ingest("first").await?, "first");
    /// assert_eq!(ingest("redelivered").await?, "first"); // the key is the whole request
    /// # Ok(()) }
    /// ```
    pub fn fingerprint_none(self) -> Operation<P, U, Stated, R> {
        self.restate()
    }

    /// Like [`fingerprint`](Self::fingerprint), naming the part (the attribute passes
    /// each parameter by name).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let moved = idem
    ///     .operation("transfer", "t-1")
    ///     .retain(Duration::from_secs(3600))
    ///     .fingerprint_part("from", "acct-1")
    ///     .fingerprint_part("cents", &500u64)
    ///     .run(|| async { Ok::<_, IdemError>(true) })
    ///     .await?;
    /// # assert!(moved);
    /// # Ok(()) }
    /// ```
    pub fn fingerprint_part<V: Serialize + ?Sized>(
        mut self,
        part: &str,
        value: &V,
    ) -> Operation<P, U, Stated, R> {
        if let Err(message) = self.fingerprint.add(part, value) {
            let name = self.id.name.clone();
            self.fail(IdemError::Codec {
                name,
                message: format!("cannot fingerprint `{part}`: {message}"),
            });
        }
        self.restate()
    }

    /// The outcome's schema version (default 1). Bump it when `T` changes shape.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let (cents, currency) = idem
    ///     .operation("price", "sku-1")
    ///     .retain(Duration::from_secs(3600))
    ///     .version(2) // version 1 recorded a bare number of cents
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>((1999u64, "EUR".to_owned())) })
    ///     .await?;
    /// # assert_eq!((cents, currency.as_str()), (1999, "EUR"));
    /// # Ok(()) }
    /// ```
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Records every `Err` and replays it like a success (`errors = record`); the error
    /// type must be [`RecordableError`] (`Serialize + DeserializeOwned`).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// #[derive(Debug, serde::Serialize, serde::Deserialize)]
    /// enum PayError { Declined, Idem(String) }
    /// # impl From<IdemError> for PayError {
    /// #     fn from(e: IdemError) -> Self { PayError::Idem(e.to_string()) }
    /// # }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let refund = || {
    ///     idem.operation("refund", "r-1")
    ///         .retain(Duration::from_secs(3600))
    ///         .record_errors()
    ///         .fingerprint_none()
    ///         .run(|| async { Err::<u64, _>(PayError::Declined) })
    /// };
    /// assert!(matches!(refund().await, Err(PayError::Declined)));
    /// let (again, info) = idem_runtime::observe(refund()).await;
    /// assert!(matches!(again, Err(PayError::Declined)) && info.replayed());
    /// # Ok(()) }
    /// ```
    pub fn record_errors(self) -> Operation<RecordErrors, U, F, R> {
        self.with_policy(RecordErrors)
    }

    /// Decides per error with `classify` (`classify = path`); the error type must be
    /// [`RecordableError`] (`Serialize + DeserializeOwned`).
    ///
    /// ```
    /// # use idem_runtime::{Disposition, Idem, IdemError};
    /// # use std::time::Duration;
    /// #[derive(Debug, serde::Serialize, serde::Deserialize)]
    /// enum PayError { Declined, Idem(String) }
    /// # impl From<IdemError> for PayError {
    /// #     fn from(e: IdemError) -> Self { PayError::Idem(e.to_string()) }
    /// # }
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// fn by_kind(e: &PayError) -> Disposition {
    ///     match e {
    ///         PayError::Declined => Disposition::Record, // final: replay it
    ///         PayError::Idem(_) => Disposition::Release, // nothing happened: retry
    ///     }
    /// }
    /// let idem = Idem::memory();
    /// let r = idem
    ///     .operation("pay", "p-1")
    ///     .retain(Duration::from_secs(3600))
    ///     .classify(by_kind)
    ///     .fingerprint_none()
    ///     .run(|| async { Err::<u64, _>(PayError::Declined) })
    ///     .await;
    /// # assert!(matches!(r, Err(PayError::Declined)));
    /// # Ok(()) }
    /// ```
    pub fn classify<C>(self, classify: C) -> Operation<Classify<C>, U, F, R> {
        self.with_policy(Classify(classify))
    }

    /// Converts outcomes recorded under another [`version`](Self::version).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let price = |version: u32| {
    ///     idem.operation("price", "sku-1")
    ///         .retain(Duration::from_secs(3600))
    ///         .version(version)
    ///         .fingerprint_none()
    /// };
    /// price(1).run(|| async { Ok::<_, IdemError>(1999u64) }).await?;
    /// let cents_to_money = |_from: u32, old: serde_json::Value| -> Result<_, IdemError> {
    ///     Ok((old.as_u64().unwrap_or_default(), "EUR".to_owned()))
    /// };
    /// let v2 = price(2)
    ///     .upgrade(cents_to_money)
    ///     .run(|| async { Ok::<_, IdemError>((0u64, "USD".to_owned())) })
    ///     .await?;
    /// assert_eq!(v2, (1999, "EUR".to_owned())); // the version 1 outcome, upgraded
    /// # Ok(()) }
    /// ```
    pub fn upgrade<G>(self, upgrade: G) -> Operation<P, UpgradeWith<G>, F, R> {
        self.rebuild(|policy, _| (policy, UpgradeWith(upgrade)))
    }

    /// The same operation in another type state.
    fn restate<F2, R2>(self) -> Operation<P, U, F2, R2> {
        self.rebuild(|policy, upgrade| (policy, upgrade))
    }

    /// This operation, once both its fingerprint and its retention were stated.
    pub(crate) fn stated(self) -> Operation<P, U>
    where
        F: FingerprintStated,
        R: RetentionStated,
    {
        self.restate()
    }

    fn with_policy<Q>(self, policy: Q) -> Operation<Q, U, F, R> {
        self.rebuild(|_, upgrade| (policy, upgrade))
    }

    /// The operation with its error policy and upgrade made over by `parts`, in any
    /// type state.
    fn rebuild<P2, U2, F2, R2>(
        self,
        parts: impl FnOnce(P, U) -> (P2, U2),
    ) -> Operation<P2, U2, F2, R2> {
        let Operation {
            idem,
            id,
            invalid,
            fingerprint,
            retain,
            lease,
            in_flight,
            on_takeover,
            on_store_error,
            version,
            policy,
            upgrade,
            stated: _,
        } = self;
        let (policy, upgrade) = parts(policy, upgrade);
        Operation {
            idem,
            id,
            invalid,
            fingerprint,
            retain,
            lease,
            in_flight,
            on_takeover,
            on_store_error,
            version,
            policy,
            upgrade,
            stated: PhantomData,
        }
    }

    /// The operation's identity as stored, for matching [`Idem::list`] rows and for
    /// [`Idem::resolve`].
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let id = idem.operation("charge", "order-1").scope("acme").id().clone();
    /// assert_eq!(id.name, "charge");
    /// assert!(idem.get(&id).await?.is_none()); // nothing recorded under it yet
    /// # Ok(()) }
    /// ```
    pub fn id(&self) -> &OperationId {
        &self.id
    }

    pub(crate) fn decode_outcome<T, E>(&self, outcome: OutcomeRef<'_>) -> Result<T, E>
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
            return match self.policy.decode(outcome.body) {
                Ok(e) => Err(e),
                Err(m) => Err(codec(format!("cannot decode the recorded error: {m}")).into()),
            };
        }
        if outcome.version != self.version {
            let value: serde_json::Value = serde_json::from_slice(outcome.body)
                .map_err(|e| codec(format!("the recorded outcome is not JSON: {e}")))?;
            return Ok(self.upgrade.upgrade(
                self.id.name.as_str(),
                outcome.version,
                self.version,
                value,
            )?);
        }
        serde_json::from_slice(outcome.body).map_err(|e| {
            codec(format!(
                "cannot decode the recorded outcome as this build's type: {e}; if the type \
                 changed shape, bump `version` and add `upgrade`"
            ))
            .into()
        })
    }

    /// The first error the builder met (an oversized key, a failed fingerprint).
    pub(crate) fn take_invalid(&mut self) -> Result<(), IdemError> {
        self.invalid.take().map_or(Ok(()), |e| Err(*e))
    }

    pub(crate) fn idem_handle(&self) -> Result<Idem, IdemError> {
        self.idem.clone().ok_or(IdemError::NoStore)
    }

    /// The fingerprint as the store holds it (keyed under `hash_keys`): the one value
    /// every claim, replay read and cache lookup of this operation compares.
    pub(crate) fn fingerprint_bytes(&self) -> [u8; 32] {
        let fingerprint = self.fingerprint.finish();
        match &self.idem {
            Some(idem) => idem.store_fingerprint(fingerprint),
            None => fingerprint,
        }
    }
}

/// What transactional mode reads of an operation.
#[cfg(feature = "_sql")]
impl<P, U> Operation<P, U> {
    pub(crate) fn retain_for(&self) -> Duration {
        self.retain
    }

    pub(crate) fn lease_for(&self) -> Duration {
        self.lease
    }
}

impl Idem {
    /// Starts configuring one operation, identified by `name` and `key` (and, with
    /// [`Operation::scope`], a scope).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let order_id = 42u64;
    /// let receipt = idem
    ///     .operation("charge", &order_id)
    ///     .retain(Duration::from_secs(86_400))
    ///     .fingerprint(&1999u64)
    ///     .run(|| async { Ok::<_, IdemError>(format!("receipt {order_id}")) })
    ///     .await?;
    /// # assert_eq!(receipt, "receipt 42");
    /// # Ok(()) }
    /// ```
    pub fn operation<K: KeyPart + ?Sized>(&self, name: &str, key: &K) -> NewOperation {
        Operation::new(Some(self.clone()), name, key)
    }
}

/// A body's result as it will be stored: decided once, for the leased and the
/// transactional paths alike.
pub(crate) enum Encoded<T, E> {
    /// Record this outcome, then answer with the result.
    Record(StoredOutcome, Result<T, E>),
    /// Release the claim: a retry runs the body again.
    Release(E),
    /// The effect may have happened: park the operation in UNKNOWN.
    Unknown(E),
    /// The body ran but its result cannot be recorded.
    Unrecordable(Unrecordable),
}

/// Why a result cannot be recorded.
pub(crate) enum Unrecordable {
    /// The `Ok` value does not serialize.
    Outcome(String),
    /// The `Err` value does not serialize.
    Error(String),
    /// The outcome is over the cap.
    TooLarge(usize),
}

impl Unrecordable {
    /// The error to answer with when the body ran and its effect may stand; `then` says
    /// what became of the operation.
    pub(crate) fn error(&self, name: &str, max: usize, then: &str) -> IdemError {
        self.answer(name, max, then, true)
    }

    /// The error to answer with when the body's writes were rolled back with its claim,
    /// so nothing took effect; `then` says so.
    #[cfg(feature = "_sql")]
    pub(crate) fn rolled_back(&self, name: &str, max: usize, then: &str) -> IdemError {
        self.answer(name, max, then, false)
    }

    fn answer(&self, name: &str, max: usize, then: &str, in_doubt: bool) -> IdemError {
        let name = name.to_owned();
        match self {
            Unrecordable::Outcome(e) => IdemError::Codec {
                name,
                message: format!("the body ran but its outcome cannot be serialized ({e}); {then}"),
            },
            Unrecordable::Error(e) => IdemError::Codec {
                name,
                message: format!(
                    "the body's error cannot be serialized for recording ({e}); {then}"
                ),
            },
            Unrecordable::TooLarge(len) => IdemError::OutcomeTooLarge {
                name,
                len: *len,
                max,
                in_doubt,
            },
        }
    }
}

impl<P, U> Operation<P, U> {
    /// What `out` becomes, with outcomes over `max` bytes refused. With
    /// `unknown_is_record` an error classified `Unknown` is recorded (transactional mode,
    /// where nothing is in doubt).
    pub(crate) fn encode<T: Serialize, E>(
        &self,
        out: Result<T, E>,
        max: usize,
        unknown_is_record: bool,
    ) -> Encoded<T, E>
    where
        P: ErrorPolicy<E>,
    {
        let (body, is_err, result) = match out {
            Ok(v) => match serde_json::to_vec(&v) {
                Ok(body) => (body, false, Ok(v)),
                Err(e) => return Encoded::Unrecordable(Unrecordable::Outcome(e.to_string())),
            },
            Err(err) => match self.policy.disposition(&err) {
                Disposition::Release => return Encoded::Release(err),
                Disposition::Unknown if !unknown_is_record => return Encoded::Unknown(err),
                Disposition::Record | Disposition::Unknown => match self.policy.encode(&err) {
                    Ok(body) => (body, true, Err(err)),
                    Err(m) => return Encoded::Unrecordable(Unrecordable::Error(m)),
                },
            },
        };
        if body.len() > max {
            return Encoded::Unrecordable(Unrecordable::TooLarge(body.len()));
        }
        let outcome = StoredOutcome::new(body, is_err, self.version);
        Encoded::Record(outcome, result)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Idem, IdemError};

    /// A finished operation's identity is the next one's on the same thread, and it
    /// carries nothing over: a scope set on the first is not the second's.
    #[tokio::test(flavor = "current_thread")]
    async fn an_identity_is_reused_and_starts_empty() {
        let spare = || super::SPARE_IDS.with(|s| s.borrow().len());
        let idem = Idem::memory();
        let before = spare();
        let r = idem
            .operation("charge", "k1")
            .scope("tenant-a")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(1u32) })
            .await
            .unwrap();
        assert_eq!(r, 1);
        assert_eq!(spare(), before + 1, "the finished identity was not kept");
        let second = idem.operation("refund", &7u64);
        assert_eq!(spare(), before, "the kept identity was not taken");
        let id = second.id();
        assert_eq!((id.scope.as_str(), id.name.as_str()), ("", "refund"));
        assert_eq!(id.key, crate::KeyPart::encode_key(&7u64));
        // A key over the limit is still measured before it is stored.
        let long = "x".repeat(300);
        let r = idem
            .operation("charge", long.as_str())
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(1u32) })
            .await;
        assert!(matches!(r, Err(IdemError::KeyTooLong { .. })), "{r:?}");
    }
}
