//! Make side-effecting async functions safe to call more than once.
//!
//! `#[idempotent]` turns an async function into an atomic **claim → execute →
//! record** sequence against a durable store: a retried charge, email or webhook
//! produces one effect, and the retry gets the recorded result back.
//!
//! ```
//! use idem_runtime::{idempotent, Idem, IdemError};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, Debug, PartialEq)]
//! struct Receipt { order: u64, cents: u64 }
//!
//! #[idempotent(store = idem, key = order, scope = tenant, retain = "7d")]
//! async fn charge(idem: &Idem, tenant: &str, order: u64, cents: u64) -> Result<Receipt, IdemError> {
//!     // runs at most once per (tenant, "charge", order) within 7 days
//!     Ok(Receipt { order, cents })
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! let idem = Idem::sqlite("sqlite::memory:").await?;
//! let first = charge(&idem, "acme", 42, 1999).await?;
//! let retry = charge(&idem, "acme", 42, 1999).await?;     // replayed, body not run
//! assert_eq!(first, retry);
//! let other = charge(&idem, "acme", 42, 5000).await;      // same key, other payload
//! assert!(matches!(other, Err(IdemError::Mismatch { .. })));
//! # Ok(()) }
//! ```
//!
//! Everything the attribute does is available without it, through
//! [`Idem::operation`], for closures, dynamic keys and other macros; the attribute's
//! expansion is a short call into that builder. A builder call states its retention and
//! its fingerprint, or [`run`](Operation::run) does not compile:
//!
//! ```
//! # use idem_runtime::{Idem, IdemError};
//! # use std::time::Duration;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! # let idem = Idem::memory();
//! # let (tenant, order_id, cents) = ("acme", "order-42", 1999u64);
//! let receipt = idem
//!     .operation("charge", order_id)
//!     .scope(tenant)
//!     .retain(Duration::from_secs(7 * 86_400))
//!     .fingerprint(&(tenant, cents))
//!     .run(|| async { Ok::<_, IdemError>(format!("charged {cents}")) })
//!     .await?;
//! # assert_eq!(receipt, "charged 1999");
//! # Ok(()) }
//! ```
//!
//! # Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `sqlite` | yes | [`Idem::sqlite`], the embedded store ([`guide::sqlite`]) |
//! | `postgres` | | [`Idem::postgres`], the production store ([`guide::postgres`]) |
//! | `mysql` | | [`Idem::mysql`], MySQL and MariaDB ([`guide::mysql`]) |
//! | `redis` | | [`Idem::redis`], Redis and Valkey, standalone or cluster ([`store::redis`]) |
//! | `uuid` | | `uuid::Uuid` as a [`KeyPart`] |
//! | `metrics` | | counters and a histogram through the `metrics` facade ([`metrics`]) |
//! | `mcp` | | idempotent tools for MCP servers on rmcp ([`mcp`]) |
//! | `axum` | | the `Idempotency-Key` header for axum services ([`http`]) |
//! | `client` | | the operation's downstream key sent by tower HTTP clients ([`client`]) |
//! | `reqwest` | | the same for reqwest, as reqwest-middleware middleware ([`client::PropagateKey`]) |
//! | `encryption` | | outcomes, recorded errors and step values encrypted at rest (`IdemBuilder::encrypt`, `Keyring`) |
//!
//! Any SQL feature adds [`Idem::from_pool`] (the application's own sqlx pool),
//! [transactional mode](guide::transactions) and the shipped DDL ([`schema`]). With no
//! feature at all there remain the attribute, the builder, [`Idem::memory`] and the
//! queue mapping ([`queue`]). The integrations' heavy dependencies sit behind their
//! features and are never in the default build.
//!
//! # Where to read on
//!
//! - What idem promises and where each promise ends: [`guide::guarantees`].
//! - HTTP services: [`http`]. MCP tools: [`mcp`]. Queue consumers: [`queue`].
//!   Calling other services with the operation's key: [`client`].
//!   Effects in your own database: [`guide::transactions`].
//! - The stores, their contract and their time bounds: [`store`], and one page per
//!   store in [`guide`].
//! - Running it (purge, stuck claims, reconciliation, metrics, the `idem` command):
//!   [`guide::operations`].
//! - The attribute's arguments, one section each: [`idempotent`].
//!
//! # Guarantees, in short
//!
//! - The claim is one atomic statement in the store: of N concurrent callers with one
//!   key, one runs the body; the others wait for its outcome or are told it is in
//!   flight.
//! - A completed outcome is replayed for `retain`; the same key with another payload is
//!   [`IdemError::Mismatch`], never a run and never the old outcome.
//! - A body that errors (with the default `errors = release`) runs again on retry; its
//!   completed [steps](step) replay rather than run again.
//! - A body that crashes, panics or is cancelled holds its claim until its lease lapses
//!   (the lease is renewed while the call's future is alive); then the next caller
//!   runs it again at a higher epoch, and the late finisher's outcome is refused
//!   ([`IdemError::Fenced`]). Effects outside the store are therefore *at least once*
//!   across crashes: pass [`Current::downstream_key`] to the downstream system so it
//!   deduplicates (the [`client`] layers do for HTTP calls), or use `on_takeover =
//!   unknown`.
//! - Replays are not authorization: authorize before the call, and put the principal
//!   in `scope`.
//!
//! The full text, with bounds, network faults and the memory store's weaker promise,
//! is [`guide::guarantees`].
#![cfg_attr(docsrs, feature(doc_cfg))]
// The internal features are implied by the store features; the docs name those.
#![cfg_attr(
    docsrs,
    doc(auto_cfg(hide(feature = "_sql", feature = "_sql_server", feature = "_sql_group")))
)]
#![warn(missing_docs, unreachable_pub, rust_2018_idioms)]

mod bounded;
mod builder;
mod cache;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod connect;
mod context;
mod error;
mod fingerprint;
pub mod guide;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod http;
mod idem;
mod key;
mod key_display;
#[cfg(feature = "lambda")]
#[cfg_attr(docsrs, doc(cfg(feature = "lambda")))]
pub mod lambda;
mod lease;
mod limit;
mod machine;
#[cfg(feature = "mcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "mcp")))]
pub mod mcp;
pub mod metrics;
mod names;
mod op;
pub mod queue;
mod seal;
mod secret;
mod step;
mod step_state;
pub mod store;
mod tx;

#[doc = include_str!("idempotent.md")]
#[doc(inline)]
pub use idem_macros::idempotent;

#[cfg(feature = "_sql")]
pub use builder::IntoStore;
pub use builder::{DEFAULT_MAX_OUTCOME_BYTES, DEFAULT_STORE_TIMEOUT, IdemBuilder};
pub use context::{CallInfo, Current, current, observe, try_current};
pub use error::{BoxError, IdemError, OpenFailure};
pub use fingerprint::fingerprint;
pub use idem::{Idem, ReaperHandle};
pub use key::KeyPart;
pub use key_display::DisplayKey;
pub use limit::ClaimLimit;
pub use op::{
    Classify, Disposition, ErrorPolicy, FingerprintStated, InFlight, MAX_KEY_BYTES,
    MAX_LEASE_OR_WAIT, NewOperation, NoUpgrade, OnStoreError, Operation, RecordErrors,
    ReleaseErrors, RetentionStated, Stated, Unstated, Upgrade, UpgradeWith,
};
pub use op::{RecordableError, RecordableOutcome};
#[cfg(feature = "encryption")]
#[cfg_attr(docsrs, doc(cfg(feature = "encryption")))]
pub use seal::Keyring;
pub use step::{MAX_STEP_LABEL, step};
pub use store::{
    ListFilter, OperationId, RecordDetail, RecordInfo, Resolution, State, Stats, Takeover,
};
pub use tx::{TxConnection, TxGuard, TxStep};

/// The SQL idem runs on open, for teams that apply DDL themselves
/// ([`IdemBuilder::migrate`]`(false)`), with the default table name.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::BoxError> {
/// use idem_runtime::{Idem, schema::SQLITE_SCHEMA_SQL};
///
/// let pool = sqlx::sqlite::SqlitePoolOptions::new()
///     .max_connections(1)
///     .connect("sqlite::memory:")
///     .await?;
/// sqlx::raw_sql(SQLITE_SCHEMA_SQL).execute(&pool).await?; // your migration tool's job
/// let idem = Idem::builder().migrate(false).pool(pool).await?;
/// # let _ = idem; Ok(()) }
/// # #[cfg(not(feature = "sqlite"))]
/// # fn main() {}
/// ```
///
/// The `idem schema` command prints the same SQL for another table name.
#[cfg(feature = "_sql")]
pub mod schema {
    // One constant a SQL backend, each beside its backend's `mod` line in `store`.
    pub use crate::store::schemas::*;
}

/// What the benches read of the fingerprint. Not a stable API.
#[doc(hidden)]
pub mod bench {
    pub use crate::fingerprint::{canonical_encoding, encoded_len, fingerprint_with_bound};
}

/// What code generated by `#[idempotent]` calls. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::names::{DefaultedName, OpName, Registered};
    pub use crate::tx::TxStep;
    pub use crate::{
        Disposition, Idem, IdemError, InFlight, KeyPart, OnStoreError, Operation, Takeover,
    };
    pub use ::core::time::Duration;
    pub use ::inventory;

    /// Not a stable API: a parameter the attribute puts in the fingerprint by default.
    /// Every `Serialize` type is one; the trait exists for its compile error, which says
    /// what to do where serde's own would point into idem's internals.
    #[diagnostic::on_unimplemented(
        message = "a parameter of type `{Self}` is fingerprinted, but `{Self}` is not \
                   `Serialize`",
        label = "this parameter is in the fingerprint: mark it `#[idem(skip)]` or give its \
                 type a serde impl",
        note = "`#[idem(skip)]` is for what is not part of the request: an `IdempotencyKey` \
                (the operation's key already), a client, a connection; \
                `#[derive(serde::Serialize)]` is for what is",
        note = "by default every parameter but `self`, the store and `tx` is fingerprinted; \
                `fingerprint = EXPR` states the fingerprint instead"
    )]
    pub trait FingerprintedParam: ::serde::Serialize {}

    // Reported as the trait above, not as the serde bound the type misses.
    #[diagnostic::do_not_recommend]
    impl<T: ::serde::Serialize + ?Sized> FingerprintedParam for T {}

    /// Not a stable API: [`Operation::fingerprint_part`] for a parameter the attribute
    /// fingerprints by default.
    pub fn fingerprint_param<P, U, F, R, V>(
        op: Operation<P, U, F, R>,
        name: &str,
        value: &V,
    ) -> Operation<P, U, crate::Stated, R>
    where
        V: FingerprintedParam + ?Sized,
    {
        op.fingerprint_part(name, value)
    }

    /// Not a stable API: a key type a client chooses (an `Idempotency-Key` header, an
    /// MCP tool's `idempotency_key` argument). Such a key needs the caller's principal
    /// in `scope`, or one client's key answers another's request.
    pub trait ClientChosen {}
    #[cfg(feature = "axum")]
    impl ClientChosen for crate::http::IdempotencyKey {}
    #[cfg(feature = "mcp")]
    impl ClientChosen for crate::mcp::IdempotencyKey {}
    impl<T: ClientChosen + ?Sized> ClientChosen for &T {}

    /// Not a stable API: implemented by nothing, so a client-chosen key of an operation
    /// without `scope` is a compile error that says what to do.
    #[diagnostic::on_unimplemented(
        message = "this key is chosen by the client (an `IdempotencyKey`), but the operation \
                   has no `scope`",
        label = "a key another principal can send too",
        note = "add `scope = <the caller's principal>` (the authenticated user, tenant or API \
                key id), so that a key reused by another principal is another operation rather \
                than a replay of this one's outcome",
        note = "where every caller is one principal on purpose, say so: `scope = \"global\"`"
    )]
    pub trait ScopedByPrincipal {}

    /// Not a stable API: an unscoped operation's key, checked at compile time by method
    /// resolution (a client-chosen key picks [`ClientChosenCheck`], any other key
    /// [`AnyKeyCheck`]); the check is never run.
    pub struct KeyCheck<'a, K: ?Sized>(pub &'a K);

    /// Not a stable API: see [`KeyCheck`].
    pub trait ClientChosenCheck {
        /// Refused at compile time.
        fn check_unscoped_key(&self)
        where
            Self: ScopedByPrincipal;
    }
    impl<K: ClientChosen + ?Sized> ClientChosenCheck for KeyCheck<'_, K> {
        fn check_unscoped_key(&self)
        where
            Self: ScopedByPrincipal,
        {
        }
    }

    /// Not a stable API: see [`KeyCheck`].
    pub trait AnyKeyCheck {
        /// Accepted.
        fn check_unscoped_key(&self) {}
    }
    impl<K: ?Sized> AnyKeyCheck for &KeyCheck<'_, K> {}

    /// Not a stable API: an operation on the store given as `store = …`, named by a
    /// string (`name = "…"`) or by the function's [`DefaultedName`].
    pub fn operation<S, N, K>(store: &S, name: &N, key: &K) -> crate::NewOperation
    where
        S: AsRef<Idem> + ?Sized,
        N: OpName + ?Sized,
        K: KeyPart + ?Sized,
    {
        name.operation(Some(store.as_ref().clone()), key)
    }

    /// Not a stable API: an operation on the global store (`NoStore` at run if unset).
    pub fn global_operation<N, K>(name: &N, key: &K) -> crate::NewOperation
    where
        N: OpName + ?Sized,
        K: KeyPart + ?Sized,
    {
        name.operation(Idem::global(), key)
    }
}
