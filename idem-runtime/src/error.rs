//! The one error type of idem, and the error a store returns.

use std::time::Duration;

/// A boxed error from the store's database driver, kept opaque so driver types stay private.
///
/// Also a convenient error type for bodies and examples: it implements
/// `From<IdemError>`, as every body's error type must.
///
/// ```
/// use idem_runtime::{BoxError, Idem, idempotent};
///
/// #[idempotent(store = idem, key = id, retain = "1h")]
/// async fn import(idem: &Idem, id: u64) -> Result<u64, BoxError> {
///     let parsed: u64 = "42".parse()?; // any error type converts
///     Ok(parsed + id)
/// }
/// ```
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong around an idempotent call.
///
/// Each message says what happened and what the caller should do. The body's own
/// error type must implement `From<IdemError>` so these reach the caller through the
/// function's ordinary `Result`.
///
/// ```
/// use idem_runtime::{Idem, IdemError, InFlight};
/// use std::time::Duration;
///
/// #[derive(Debug, thiserror::Error)]
/// enum PayError {
///     #[error("card declined")]
///     Declined,
///     #[error(transparent)]
///     Idem(#[from] IdemError),
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let idem = Idem::memory();
/// let charge = || {
///     idem.operation("charge", "order-1")
///         .retain(Duration::from_secs(3600))
///         .fingerprint_none()
///         .in_flight(InFlight::Reject)
/// };
/// let (started, running) = tokio::sync::oneshot::channel();
/// let (finish, hold) = tokio::sync::oneshot::channel::<()>();
/// let first = tokio::spawn(charge().run(|| async move {
///     started.send(()).unwrap();
///     hold.await.unwrap(); // the first call is still running
///     Ok::<_, PayError>(1999u64)
/// }));
/// running.await.unwrap();
/// match charge().run(|| async { Ok::<_, PayError>(1999) }).await {
///     // A duplicate while the first call runs: retry later with the same key.
///     Err(PayError::Idem(e)) if e.is_retryable() => assert!(e.retry_after().is_some()),
///     other => panic!("{other:?}"),
/// }
/// finish.send(()).unwrap();
/// assert_eq!(first.await.unwrap().unwrap(), 1999);
/// let replay = charge().run(|| async { Err::<u64, _>(PayError::Declined) }).await; // not run
/// assert_eq!(replay.unwrap(), 1999);
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdemError {
    /// The key was first used with another payload.
    #[error(
        "operation `{name}` was already called with this key and a different payload; \
         a key names one business intent, so use a new key for a new request"
    )]
    Mismatch {
        /// The operation's name.
        name: String,
    },

    /// Another call with the same key is running.
    #[error("operation `{name}` with this key is already running; retry after {retry_after:?}")]
    InFlight {
        /// The operation's name.
        name: String,
        /// The remaining time of the running call's lease, by the store's clock.
        retry_after: Duration,
    },

    /// The call would have started a new operation, and its caller has used up its
    /// allowance of new claims ([`IdemBuilder::limit_new_claims`]): nothing ran and
    /// nothing was written, so a retry with the same key after `retry_after` starts it.
    ///
    /// [`IdemBuilder::limit_new_claims`]: crate::IdemBuilder::limit_new_claims
    #[error(
        "operation `{name}` not started: this caller has started too many new operations \
         for now (nothing ran, nothing was recorded); retry with the same key after \
         {retry_after:?}"
    )]
    RateLimited {
        /// The operation's name.
        name: String,
        /// How long until the caller's allowance has room for one more claim.
        retry_after: Duration,
    },

    /// An earlier attempt may or may not have had its effect; the operation needs
    /// reconciliation.
    #[error(
        "operation `{name}` is in the UNKNOWN state (epoch {epoch}): an earlier attempt may \
         have had its effect; check the downstream system, then call `Idem::resolve`"
    )]
    Unknown {
        /// The operation's name.
        name: String,
        /// The epoch of the attempt whose effect is unknown.
        epoch: u64,
    },

    /// This call's claim was taken over after its lease lapsed; its outcome was not written.
    #[error(
        "operation `{name}` epoch {epoch} lost its claim (lease lapsed and another caller took \
         over); its outcome was not recorded; lengthen `lease` if the body is slow but alive"
    )]
    Fenced {
        /// The operation's name.
        name: String,
        /// The epoch this call held.
        epoch: u64,
    },

    /// No store was passed and none was set with `Idem::set_global`.
    #[error(
        "no idem store: pass `store = ...` to `#[idempotent]` or call `Idem::set_global` at startup"
    )]
    NoStore,

    /// The encoded key is over the cap.
    #[error(
        "the key of operation `{name}` encodes to {len} bytes, over the cap of {max}; \
         key on a business identifier, not on the payload"
    )]
    KeyTooLong {
        /// The operation's name.
        name: String,
        /// The encoded length.
        len: usize,
        /// The cap.
        max: usize,
    },

    /// The key is empty, or one of its text parts is: an empty identifier is almost
    /// always a missing one (a field defaulted to `""`, an unset header), and taking it
    /// as a key would make every such request one operation. Nothing was written.
    #[error(
        "the key of operation `{name}` is empty or has an empty text part; an empty \
         identifier is almost always a missing one (an unset field or header), so refuse \
         the request before the call or pass its real identifier"
    )]
    EmptyKey {
        /// The operation's name.
        name: String,
    },

    /// The encoded scope is over the cap.
    #[error(
        "the scope of operation `{name}` encodes to {len} bytes, over the cap of {max}; \
         scope on a tenant or principal identifier"
    )]
    ScopeTooLong {
        /// The operation's name.
        name: String,
        /// The encoded length.
        len: usize,
        /// The cap.
        max: usize,
    },

    /// The operation name is empty or over the cap.
    #[error("operation name `{name}` is empty or over {max} bytes; use a short stable name")]
    BadName {
        /// The name given.
        name: String,
        /// The cap.
        max: usize,
    },

    /// The outcome is over the cap, so it was not recorded. `in_doubt` says whether an
    /// effect may have happened, which decides what a retry may do.
    #[error(
        "the outcome of operation `{name}` is {len} bytes, over the cap of {max}{then}; return a \
         smaller value (an id, not the document) or raise `max_outcome_bytes`",
        then = too_large_then(*in_doubt)
    )]
    OutcomeTooLarge {
        /// The operation's name.
        name: String,
        /// The serialized length.
        len: usize,
        /// The cap.
        max: usize,
        /// Whether an effect may have happened. `true` when a body or step ran outside
        /// a transaction: the operation is not released to run again but held in
        /// UNKNOWN, so check the effect and settle it with `Idem::resolve`. `false`
        /// when nothing took effect: a transactional body's writes were rolled back with
        /// its claim (a retry runs it afresh), or an operator's resolution was refused
        /// before anything was written.
        in_doubt: bool,
    },

    /// Too many callers are already waiting on this in-flight key.
    #[error("too many callers are waiting on operation `{name}`; retry after {retry_after:?}")]
    TooManyWaiters {
        /// The operation's name.
        name: String,
        /// The remaining time of the running call's lease.
        retry_after: Duration,
    },

    /// The store could not be reached or refused a statement. From a call, the body did
    /// not run (or, in transactional mode, the transaction must be rolled back and
    /// retried).
    #[error("idem store error during {during}{hint}: {source}", hint = store_hint(during))]
    Store {
        /// What idem was doing.
        during: &'static str,
        /// Whether retrying the whole call may succeed (a serialization failure, a
        /// dropped connection).
        retryable: bool,
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// The body ran but its outcome could not be recorded before the lease ran out.
    #[error(
        "operation `{name}` ran (epoch {epoch}) but its outcome could not be recorded: {source}; \
         the claim stays IN_PROGRESS until its lease lapses, so check the effect before retrying"
    )]
    Unrecorded {
        /// The operation's name.
        name: String,
        /// The epoch that ran.
        epoch: u64,
        /// The last store error.
        #[source]
        source: BoxError,
    },

    /// An outcome or fingerprint could not be encoded or decoded.
    #[error("operation `{name}`: {message}")]
    Codec {
        /// The operation's name.
        name: String,
        /// What failed and what to do.
        message: String,
    },

    /// A recorded outcome, error or step value is encrypted
    /// ([`IdemBuilder::encrypt`](crate::IdemBuilder::encrypt)) and cannot be opened:
    /// its key id is not in this `Idem`'s keyring (or it has none), or it fails
    /// authentication (altered, or copied from another record). It is never replayed as
    /// clear text, and nothing runs. The integrations map it as an internal error: HTTP
    /// `500` (problem type `internal`), an MCP tool error (`outcome_unreadable`), and in
    /// the queue mapping a redelivery with an alert when the key is unknown (a keyring
    /// missing a retired key is a deployment fault) or termination when it fails to
    /// open (no redelivery can read it).
    #[error(
        "operation `{name}`: the recorded value is encrypted under key `{key_id}` and cannot \
         be opened: {reason}; it is not replayed"
    )]
    Undecryptable {
        /// The operation's name (and the step's label, for a step).
        name: String,
        /// The id of the key the record names.
        key_id: String,
        /// Why it cannot be opened.
        reason: OpenFailure,
    },

    /// A configuration value is invalid.
    #[error("invalid idem configuration: {message}")]
    Config {
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// Why an encrypted record cannot be opened ([`IdemError::Undecryptable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenFailure {
    /// The keyring holds no key with the record's id: a retired key left out of it.
    UnknownKey,
    /// This `Idem` has no keyring (it was opened without `IdemBuilder::encrypt`).
    NoKeyring,
    /// It fails authentication: altered, copied from another record, or sealed with
    /// other key material under the same id.
    Unauthentic,
    /// The sealed body is truncated or of a format this build does not read.
    Malformed,
}

impl OpenFailure {
    /// Whether the key is missing here (`UnknownKey`, `NoKeyring`): a deployment's fault
    /// that a keyring with the key mends, rather than a record no key opens.
    pub fn is_missing_key(&self) -> bool {
        matches!(self, OpenFailure::UnknownKey | OpenFailure::NoKeyring)
    }
}

impl std::fmt::Display for OpenFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OpenFailure::UnknownKey => {
                "the keyring has no key with this id; add it as a retired key"
            }
            OpenFailure::NoKeyring => {
                "this Idem has no keyring; open it with `IdemBuilder::encrypt`"
            }
            OpenFailure::Unauthentic => {
                "it failed authentication: it was altered, copied from another record, or \
                 sealed with other key material under the same id"
            }
            OpenFailure::Malformed => {
                "the sealed body is malformed (truncated, or of an unknown format)"
            }
        })
    }
}

fn too_large_then(in_doubt: bool) -> &'static str {
    if in_doubt {
        "; it ran, so it may have had its effect and is held in UNKNOWN rather than run \
         again: check the effect, then call `Idem::resolve`"
    } else {
        "; nothing took effect and nothing was recorded (a transactional body's writes \
         were rolled back with its claim), so a retry runs afresh"
    }
}

/// `after` in whole seconds, rounded up and at least one, for a `Retry-After` (HTTP) or
/// a `retry_after` (MCP): a client never retries at once in a loop.
#[cfg(any(feature = "axum", feature = "mcp"))]
pub(crate) fn whole_secs(after: Duration) -> u64 {
    (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1)
}

fn store_hint(during: &str) -> &'static str {
    match during {
        "claim" => " (the body did not run; retry when the store is back)",
        "savepoint" | "record" | "rollback" => " (roll the transaction back and retry it)",
        _ => "",
    }
}

impl IdemError {
    /// Whether the same call may succeed if retried later: `InFlight`, `TooManyWaiters`,
    /// `RateLimited` and retryable `Store` errors.
    pub fn is_retryable(&self) -> bool {
        match self {
            IdemError::InFlight { .. }
            | IdemError::TooManyWaiters { .. }
            | IdemError::RateLimited { .. } => true,
            IdemError::Store { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// How long to wait before retrying, where the store said.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            IdemError::InFlight { retry_after, .. }
            | IdemError::TooManyWaiters { retry_after, .. }
            | IdemError::RateLimited { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    pub(crate) fn store(during: &'static str, e: StoreError) -> Self {
        IdemError::Store {
            during,
            retryable: e.retryable,
            source: e.source,
        }
    }
}

/// An error a [`Store`](crate::store::Store) returns: the driver's error, whether a retry may
/// succeed, and whether the store could not be reached at all.
///
/// ```
/// use idem_runtime::store::StoreError;
///
/// let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
/// let e = StoreError::new(true, refused);
/// assert!(e.unreachable); // an I/O error: `fail_open` may act on it
/// let e = StoreError::new(false, "duplicate key value violates unique constraint");
/// assert!(!e.unreachable && !e.retryable); // a refusal always fails closed
/// ```
#[derive(Debug)]
pub struct StoreError {
    /// Whether a retry of the same statement may succeed.
    pub retryable: bool,
    /// The store could not be reached: a connection-level failure or a pool timeout,
    /// never a refusal, a constraint, contention or a serialization conflict. Only this
    /// lets `fail_open` run a body unprotected.
    pub unreachable: bool,
    /// The driver's error.
    pub source: BoxError,
}

impl StoreError {
    /// Wraps a driver error. It counts as [`unreachable`](Self::unreachable) when it is
    /// an I/O error (a connection refused, reset or timed out); use
    /// [`StoreError::unreachable`] or set the field to say so for other types.
    pub fn new(retryable: bool, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        StoreError {
            retryable,
            unreachable: source.is::<std::io::Error>(),
            source,
        }
    }

    /// The store could not be reached (retryable).
    pub fn unreachable(source: impl Into<BoxError>) -> Self {
        StoreError {
            retryable: true,
            unreachable: true,
            source: source.into(),
        }
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}
