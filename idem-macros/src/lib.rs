//! The `#[idempotent]` attribute, an implementation detail of `idem-runtime`, which
//! re-exports it as `idem_runtime::idempotent`. Depend on
//! `idem-runtime`, not on this crate: the expansion calls into it and the two are
//! released in lockstep.
//!
//! The macro is three phases, one module each: `attr` parses the arguments, `check`
//! validates them (including the random/time key check) and `expand` emits a short
//! call into the runtime's `Operation` builder.

#![warn(missing_docs, unreachable_pub, rust_2018_idioms)]

mod attr;
mod check;
mod expand;

use proc_macro::TokenStream;

/// Makes a side-effecting `async fn` idempotent: each call becomes an atomic
/// **claim → execute → record** against a durable store, so the body runs at most once
/// per key (within `retain`), and a retry gets the recorded outcome back.
///
/// ```ignore
/// use idem_runtime::{idempotent, Idem};
///
/// #[idempotent(store = idem, key = order.id, scope = tenant, retain = "7d")]
/// async fn charge(idem: &Idem, tenant: &str, order: &Order) -> Result<Receipt, PayError> {
///     // runs at most once per (tenant, "charge", order.id) within 7 days;
///     // a retry gets the recorded Receipt back without running the body again
///     psp.charge(order).await
/// }
/// ```
///
/// The function must be an `async fn` (free function or method; `&self`, generics and
/// where-clauses are fine) returning `Result<T, E>` (or an alias named `…Result`), with
/// `T: Serialize + DeserializeOwned` (the outcome is recorded and replayed) and
/// `E: From<IdemError>` (idem's own failures, such as `IdemError::Mismatch` or
/// `IdemError::InFlight`, come back through the function's ordinary `Result`). Its
/// future is `Send` whenever the original function's would be. Attributes, doc comments,
/// visibility and the signature are kept as written.
///
/// # What it expands to
///
/// The body becomes a future handed to the runtime's public builder, the same one you
/// can call by hand (`Idem::operation`). The example above expands to, roughly:
///
/// ```text
/// async fn charge(idem: &Idem, tenant: &str, order: &Order) -> Result<Receipt, PayError> {
///     let __idem_op = ::idem_runtime::__private::operation(&(idem), "charge", &(order.id))
///         .scope(&(tenant))
///         .retain(::idem_runtime::__private::Duration::new(604800, 0))
///         .fingerprint_part("tenant", &tenant)
///         .fingerprint_part("order", &order);
///     __idem_op.run(move || async move { /* the original body */ }).await
/// }
/// ```
///
/// Only the arguments you give are emitted; the runtime holds the defaults. The key,
/// scope and fingerprint are encoded when the builder is made, so nothing borrowed for
/// them is held across the body's `.await`s. Inside the body, `?` and `return` work as
/// in the original function.
///
/// # `key = EXPR` (required)
///
/// The operation's identity: one business intent, such as an order id, a message's
/// `(source, id)`, or the `Idempotency-Key` a client sent. Any expression over the
/// parameters whose type implements `KeyPart` (strings, integers, `bool`, `Uuid` with
/// the `uuid` feature, references to these, and tuples of these). A tuple is a
/// composite key, and its elements are borrowed, so `key = (msg.source, msg.id)` works
/// with owned `String` fields. The encoding is typed and unambiguous: `42` and `"42"`
/// are different keys, and so are `("a:b", "c")` and `("a", "b:c")`.
///
/// ```ignore
/// #[idempotent(store = idem, key = (msg.source, msg.id), retain = "3d")]
/// #[idempotent(store = idem, key = format!("charge:v1:{}", order.id), retain = "7d")]
/// ```
///
/// Rejected at compile time (see *Compile-time checks*): a key built from a random or
/// clock value anywhere in the expression, and a key that refers to no parameter.
///
/// # `scope = EXPR`
///
/// The namespace of the key: tenant, account, principal (any `KeyPart`). The same key in
/// two scopes is two operations. Default: the empty scope. Replays are not
/// authorization: authorize before the call as for a first call, and put the principal
/// in `scope` so a key reused by someone else is someone else's operation.
///
/// # `retain = "DUR"` (required)
///
/// How long a completed outcome is kept and replayed, as a string parsed at compile
/// time: `"90s"`, `"15m"`, `"24h"`, `"7d"`, or compounds like `"1h 30m"`. Size it from
/// the longest retry or redelivery horizon of the callers (client retries, queue
/// redelivery, replays): a duplicate that arrives after `retain` runs the body again.
/// Missing, zero or unparsable is a compile error.
///
/// # `store = EXPR`
///
/// The store: an expression of type `Idem` or `&Idem` (anything `AsRef<Idem>`), such as
/// a parameter or `self.idem`. A parameter named here is not fingerprinted. Default: the
/// process-wide store set with `Idem::set_global`; if none is set, the call returns
/// `Err(IdemError::NoStore)` without running the body.
///
/// ```ignore
/// impl Payments {
///     #[idempotent(store = self.idem, key = order_id, retain = "7d")]
///     async fn charge(&self, order_id: u64, cents: u64) -> Result<Receipt, PayError> { .. }
/// }
/// ```
///
/// # `name = "op"`
///
/// The operation's name, the namespace of the key within the scope. Default: the
/// function's name. Renaming the function therefore changes the name, and keys recorded
/// under the old name are no longer replayed; give `name` to keep it stable across
/// refactors.
///
/// # `lease = "DUR"`
///
/// How long a running claim is owned before another caller may take it over (its owner
/// is presumed crashed or hung). Default `"60s"`. The lease is renewed while the body is
/// being polled, so a slow but live body is not taken over; make it comfortably longer
/// than one renewal gap. Measured by the store's clock. Zero is a compile error.
///
/// # `in_flight = wait("DUR") | reject`
///
/// A duplicate that arrives while the first call is running: `wait("DUR")` waits up to
/// DUR for its outcome (default `wait("5s")`), then returns
/// `IdemError::InFlight { retry_after }`; `reject` returns `InFlight` at once (map it to
/// HTTP 409 or a delayed redelivery). `wait("0s")` is a compile error: write `reject`.
///
/// # `errors = release | record`, or `classify = PATH`
///
/// What an `Err` from the body does (give at most one of the two):
/// - `errors = release` (default): the claim is released and a retry runs the body again.
/// - `errors = record`: the error is recorded and replayed like a success.
/// - `classify = my_fn`, with `fn my_fn(&E) -> Disposition`, decides per error:
///   `Disposition::Release`, `Disposition::Record`, or `Disposition::Unknown` (the effect
///   may have happened: later duplicates get `IdemError::Unknown` until the operation is
///   resolved).
///
/// `record` and `classify` need `E: Serialize + DeserializeOwned`.
///
/// ```ignore
/// fn classify(e: &PayError) -> Disposition {
///     match e {
///         PayError::Declined => Disposition::Record,  // a decline is an answer
///         PayError::Timeout => Disposition::Unknown,  // the charge may have gone through
///         _ => Disposition::Release,
///     }
/// }
/// #[idempotent(store = idem, key = order.id, retain = "7d", classify = classify)]
/// ```
///
/// # `on_takeover = rerun | unknown`
///
/// A claim whose lease lapsed. `rerun` (default): the next claimant runs the body again,
/// at a higher epoch and with the same downstream key (`idem_runtime::current()
/// .downstream_key(..)`), so a downstream system that deduplicates sees one effect.
/// `unknown`: the operation goes to UNKNOWN for reconciliation, for effects with no
/// downstream deduplication (an email through a provider without keys).
///
/// # `fingerprint = EXPR | none`
///
/// What is bound to the key at its first use; a later call with the same key and a
/// different fingerprint gets `IdemError::Mismatch` instead of a replay of someone
/// else's outcome. Default: every parameter except `self`, the `store` parameter, the
/// `tx` parameter and those marked `#[idem(skip)]`; a patterned parameter
/// (`Parameters(args): Parameters<T>`, `(a, b): (u64, u64)`) contributes the names it
/// binds. Each fingerprinted parameter must be `Serialize`; one that is not is a compile
/// error on that parameter. `fingerprint = EXPR` fingerprints `EXPR: Serialize` instead
/// (a tuple's elements are borrowed); `fingerprint = none` binds nothing.
///
/// ```ignore
/// #[idempotent(store = idem, key = to, retain = "1d")]
/// async fn welcome(idem: &Idem, #[idem(skip)] mailer: &Mailer, to: &str) -> Result<(), MailError> { .. }
/// ```
///
/// `#[idem(...)]` attributes are removed from the output.
///
/// # `tx = IDENT`
///
/// Transactional mode: `IDENT` names a parameter `tx: &mut sqlx::Transaction<'_, DB>`
/// (PostgreSQL or SQLite). The claim and the record run inside the caller's transaction,
/// beside the body's own writes, and commit or roll back with them; the body runs in a
/// savepoint, so a released `Err` leaves none of its writes. The row lock is the claim
/// and rollback is the release, so `lease`, `in_flight`, `on_takeover` and
/// `on_store_error = fail_open` do not apply and are compile errors here. The `tx`
/// parameter is not fingerprinted. Expands to, roughly:
///
/// ```text
/// let __idem_op = /* the builder, as above */;
/// let __idem_guard = match __idem_op.begin_tx(&mut *tx).await {
///     Ok(TxStep::Replay(outcome)) => return outcome,
///     Ok(TxStep::Run(guard)) => guard,
///     Err(e) => return Err(From::from(e)),
/// };
/// let __idem_out = { let tx = &mut *tx; async move { /* the body */ }.await };
/// __idem_guard.finish(&mut *tx, __idem_out).await
/// ```
///
/// # `on_store_error = fail_closed | fail_open`
///
/// The store is unreachable at claim time. `fail_closed` (default): the call returns
/// `Err(IdemError::Store { .. })` and the body does not run. `fail_open`: the body runs
/// unprotected and a warning event is emitted, for effects where a duplicate is cheaper
/// than an outage.
///
/// # `version = N` and `upgrade = PATH`
///
/// The outcome's schema version (default 1); bump it when `T`'s serialized form changes.
/// An outcome recorded under another version is passed to
/// `upgrade: fn(u32, serde_json::Value) -> Result<T, IdemError>` (the recorded version
/// and value) if given, and is otherwise an `IdemError::Codec` naming the operation and
/// both versions: never a panic, never a silent re-run.
///
/// # `crate = path` or `crate = "path"`
///
/// Where `idem_runtime` is, for crates that re-export it:
/// `crate = my_framework::idem` or `crate = "my_framework::idem"`. Default
/// `::idem_runtime`.
///
/// # Compile-time checks
///
/// Rejected with an error on the offending tokens:
/// - a `key` or `scope` (or `fingerprint = EXPR`) built from a random or clock value
///   anywhere in the expression, including `format!`-style macro arguments, blocks (so a
///   local bound to such a value and captured inline as `{id}` is caught at its source),
///   closures and tuples: `Uuid::new_v4`, `Uuid::now_v7`, `Uuid::new_v7`,
///   `rand::random`, `random()`, `thread_rng`, `rand::rng`, `OsRng`, `fastrand::*`,
///   `getrandom`, `RandomState`, `Ulid::new`, `nanoid!`, `SystemTime::now`,
///   `Instant::now`, `Utc::now`, `Local::now`, `OffsetDateTime::now_utc`,
///   `Timestamp::now`, any `X::now`, `UNIX_EPOCH.elapsed()` and the like. Matching is on
///   paths, so a method `order.now_serving()`, a field `event.created_at` (an upstream
///   event's timestamp is a stable value), a function `clock_id()` or `Uuid::new_v5(..)`
///   passes;
/// - a `key` that refers to no parameter (every call would share one key);
/// - `retain`, `lease` or `wait` strings that do not parse, zero durations, a missing
///   `key` or `retain`, unknown or duplicate arguments, `errors` with `classify`, `tx`
///   with `lease`, `in_flight`, `on_takeover` or `fail_open`, a `tx` naming no
///   parameter, a function that is not `async` or does not return `Result`.
///
/// All mistakes in one attribute are reported together; the function itself is still
/// emitted beside the errors, so they are not followed by a cascade of others.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
