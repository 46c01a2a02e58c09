//! One idempotent operation: the builder that states it (`Idem::operation` and the
//! `Operation` methods that set its options); its identity (`id.rs`), the policies its
//! options choose (`policy.rs`), and how its outcome is encoded for the store and
//! decoded from it (`outcome.rs`). `machine/` runs it (`run`), `tx.rs` runs it inside
//! the caller's transaction (`begin_tx`).

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::error::IdemError;
use crate::fingerprint::FingerprintBuilder;
use crate::idem::Idem;
use crate::key::KeyPart;
use crate::store::{OperationId, Takeover};

mod id;
mod outcome;
mod policy;
pub(crate) use id::Id;
pub(crate) use outcome::Encoded;
pub use policy::{
    Classify, Disposition, ErrorPolicy, InFlight, NoUpgrade, OnStoreError, RecordErrors,
    RecordableError, RecordableOutcome, ReleaseErrors, Upgrade, UpgradeWith,
};

/// Longest encoded key or scope, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

const DEFAULT_LEASE: Duration = Duration::from_secs(60);
pub(super) const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// The longest `lease` and in-flight wait accepted: beyond it a value is a mistake (and
/// `Duration::MAX` would overflow clock arithmetic after the claim was written).
pub const MAX_LEASE_OR_WAIT: Duration = Duration::from_secs(366 * 86_400);

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
    /// A limit on new claims of its own (the HTTP layer's), in place of the `Idem`'s.
    pub(crate) claim_limit: Option<Arc<crate::limit::ClaimLimiter>>,
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
            claim_limit: None,
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

    /// Counts this operation's new claims against `limiter` instead of the `Idem`'s.
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) fn claim_limiter(mut self, limiter: Arc<crate::limit::ClaimLimiter>) -> Self {
        self.claim_limit = Some(limiter);
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
            claim_limit,
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
            claim_limit,
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

#[cfg(test)]
mod tests {
    use crate::{Idem, IdemError};

    /// A finished operation's identity is the next one's on the same thread, and it
    /// carries nothing over: a scope set on the first is not the second's.
    #[tokio::test(flavor = "current_thread")]
    async fn an_identity_is_reused_and_starts_empty() {
        let spare = || super::id::SPARE_IDS.with(|s| s.borrow().len());
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
