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
mod errors;
mod expand;
mod scan;

use proc_macro::TokenStream;

/// Makes a side-effecting `async fn` idempotent: each call becomes an atomic
/// **claim → execute → record** against a durable store: of the calls with one key, one
/// runs the body and the rest (within `retain`) get its recorded outcome back. The body
/// runs again only where that is safe by the rules below: after a released error, or
/// after its claim's lease lapsed (its owner crashed or stopped renewing).
///
/// ```
/// use idem_runtime::{idempotent, Idem};
/// # use idem_runtime::IdemError;
/// # use std::sync::atomic::{AtomicUsize, Ordering};
/// # #[derive(serde::Serialize)]
/// # struct Order { id: u64, cents: u64 }
/// # #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
/// # struct Receipt { cents: u64 }
/// # #[derive(Debug)]
/// # struct PayError;
/// # impl From<IdemError> for PayError {
/// #     fn from(_: IdemError) -> Self { PayError }
/// # }
/// # struct Psp(AtomicUsize);
/// # impl Psp {
/// #     async fn charge(&self, order: &Order) -> Result<Receipt, PayError> {
/// #         self.0.fetch_add(1, Ordering::SeqCst);
/// #         Ok(Receipt { cents: order.cents })
/// #     }
/// # }
/// # #[allow(non_upper_case_globals)]
/// # static psp: Psp = Psp(AtomicUsize::new(0));
///
/// #[idempotent(store = idem, key = order.id, scope = tenant, retain = "7d")]
/// async fn charge(idem: &Idem, tenant: &str, order: &Order) -> Result<Receipt, PayError> {
///     // runs at most once per (tenant, "charge", order.id) within 7 days;
///     // a retry gets the recorded Receipt back without running the body again
///     psp.charge(order).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), PayError> {
/// let idem = Idem::memory();
/// let order = Order { id: 42, cents: 1999 };
/// let receipt = charge(&idem, "acme", &order).await?;
/// let retry = charge(&idem, "acme", &order).await?; // replayed
/// assert_eq!(retry, receipt);
/// # assert_eq!(psp.0.load(Ordering::SeqCst), 1);
/// # Ok(()) }
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
///     // The defaulted name, registered with this function's place (see `name`).
///     static __IDEM_NAME: DefaultedName = DefaultedName::new("charge", module_path!(), file!(), line!());
///     inventory::submit! { Registered(&__IDEM_NAME) }
///     let __idem_op = ::idem_runtime::__private::operation(&(idem), &__IDEM_NAME, &(order.id))
///         .scope(&(tenant))
///         .retain(::idem_runtime::__private::Duration::new(604800, 0))
///         .fingerprint_part("tenant", &tenant)
///         .fingerprint_part("order", &order);
///     __idem_op.run(move || async move { /* the original body */ }).await
/// }
/// ```
///
/// Only the arguments you give are emitted (and `.fingerprint_none()` where nothing is
/// fingerprinted, since the builder runs only once its fingerprint is stated); the
/// runtime holds the defaults. The key,
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
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// static RUNS: AtomicUsize = AtomicUsize::new(0);
///
/// #[derive(serde::Serialize)]
/// struct Message { source: String, id: u64 }
///
/// #[idempotent(store = idem, key = (msg.source, msg.id), retain = "3d")]
/// async fn handle(idem: &Idem, msg: &Message) -> Result<usize, IdemError> {
///     Ok(RUNS.fetch_add(1, Ordering::SeqCst) + 1) // which run of the body this is
/// }
///
/// #[idempotent(store = idem, key = format!("charge:v1:{}", order_id), retain = "7d")]
/// async fn charge_order(idem: &Idem, order_id: u64) -> Result<u64, IdemError> {
///     Ok(order_id)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// let billing = Message { source: "billing".into(), id: 7 };
/// let shipping = Message { source: "shipping".into(), id: 7 };
/// assert_eq!(handle(&idem, &billing).await?, 1);
/// assert_eq!(handle(&idem, &billing).await?, 1); // same (source, id): replayed
/// assert_eq!(handle(&idem, &shipping).await?, 2); // another source: another key
/// assert_eq!(charge_order(&idem, 42).await?, 42);
/// # Ok(()) }
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
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// #[idempotent(store = idem, key = invoice, scope = tenant, retain = "30d")]
/// async fn send_invoice(idem: &Idem, tenant: &str, invoice: u64) -> Result<String, IdemError> {
///     Ok(format!("{tenant}: invoice {invoice} sent"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::sqlite("sqlite::memory:").await?;
/// assert_eq!(send_invoice(&idem, "acme", 1).await?, "acme: invoice 1 sent");
/// // Invoice 1 of another tenant is an operation of its own: neither a replay nor a mismatch.
/// assert_eq!(send_invoice(&idem, "globex", 1).await?, "globex: invoice 1 sent");
/// # Ok(()) }
/// ```
///
/// # `retain = "DUR"` (required)
///
/// How long a completed outcome is kept and replayed, as a string parsed at compile
/// time: `"90s"`, `"15m"`, `"24h"`, `"7d"`, or compounds like `"1h 30m"`. Size it from
/// the longest retry or redelivery horizon of the callers (client retries, queue
/// redelivery, replays): a duplicate that arrives after `retain` runs the body again.
/// Missing, zero or unparsable is a compile error.
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// // Clients retry for up to an hour: keep outcomes a little longer than that.
/// #[idempotent(store = idem, key = request_id, retain = "1h 30m")]
/// async fn sign_up(idem: &Idem, request_id: &str, email: &str) -> Result<String, IdemError> {
///     Ok(format!("account for {email}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// let account = sign_up(&idem, "req-1", "ana@example.com").await?;
/// assert_eq!(sign_up(&idem, "req-1", "ana@example.com").await?, account); // a retry in time
/// # Ok(()) }
/// ```
///
/// # `store = EXPR`
///
/// The store: an expression of type `Idem` or `&Idem` (anything `AsRef<Idem>`), such as
/// a parameter or `self.idem`. A parameter named here is not fingerprinted. Default: the
/// process-wide store set with `Idem::set_global`; if none is set, the call returns
/// `Err(IdemError::NoStore)` without running the body.
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
/// # #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
/// # struct Receipt { cents: u64 }
///
/// struct Payments {
///     idem: Idem,
/// }
///
/// impl Payments {
///     #[idempotent(store = self.idem, key = order_id, retain = "7d")]
///     async fn bill(&self, order_id: u64, cents: u64) -> Result<Receipt, IdemError> {
///         Ok(Receipt { cents })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let payments = Payments { idem: Idem::memory() };
/// let receipt = payments.bill(1, 500).await?;
/// assert_eq!(payments.bill(1, 500).await?, receipt); // replayed from `payments.idem`
/// # Ok(()) }
/// ```
///
/// Without `store`, the global store:
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// #[idempotent(key = user_id, retain = "1d")]
/// async fn send_welcome(user_id: u64) -> Result<(), IdemError> {
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// assert!(matches!(send_welcome(7).await, Err(IdemError::NoStore)));
/// Idem::set_global(Idem::sqlite("sqlite::memory:").await?); // once, at startup
/// send_welcome(7).await?;
/// # Ok(()) }
/// ```
///
/// # `name = "op"`
///
/// The operation's name, the namespace of the key within the scope. Default: the
/// function's name, without its module path, so moving the function to another module
/// keeps its records.
///
/// A function is never answered with another function's outcome. Two `#[idempotent]`
/// functions whose names default to the same one (`stripe::refund` and
/// `paypal::refund`, or methods `refund` of two types) would share records, so both are
/// refused: each call returns `IdemError::Config` naming both functions (module path,
/// name, `file:line`), whichever is called first, and neither body runs. Every
/// function with a defaulted name is registered at link time; each checks the registry
/// on its first call and keeps the verdict, so later calls cost one atomic load. Give
/// each its own `name`; the one whose existing records must still be replayed keeps
/// its old name as `name = "refund"`.
///
/// An explicit `name` is never refused: functions may share one on purpose, such as an
/// HTTP handler and a queue consumer for one operation, or a function and a builder
/// call `idem.operation("refund", ..)` (their fingerprints must then agree).
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// mod stripe {
///     # use super::*;
///     #[idempotent(store = idem, key = order_id, retain = "7d")]
///     pub async fn refund(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
///         Ok(format!("stripe refunded order {order_id}"))
///     }
/// }
///
/// mod paypal {
///     # use super::*;
///     #[idempotent(store = idem, key = order_id, retain = "7d", name = "paypal.refund")]
///     pub async fn refund(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
///         Ok(format!("paypal refunded order {order_id}"))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// stripe::refund(&idem, 7).await?;
/// // Without its `name`, this call (and the one above) would be a `Config` error.
/// assert_eq!(paypal::refund(&idem, 7).await?, "paypal refunded order 7");
/// # Ok(()) }
/// ```
///
/// Renaming the function changes its default name: keys recorded under the old name
/// are no longer replayed, so a retry that arrives after the deploy runs the body
/// again. Keep the operation's identity with the old name:
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// // Was `async fn charge`: its records stay this function's.
/// #[idempotent(store = idem, key = order_id, retain = "7d", name = "charge")]
/// async fn charge_card(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
///     Ok(format!("order {order_id} charged"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// // What the old build recorded, as its `charge` recorded it:
/// idem.operation("charge", &1u64)
///     .retain(std::time::Duration::from_secs(7 * 86_400))
///     .fingerprint_part("order_id", &1u64)
///     .run(|| async { Ok::<_, IdemError>("charged by the old build".to_owned()) })
///     .await?;
/// assert_eq!(charge_card(&idem, 1).await?, "charged by the old build"); // replayed
/// # Ok(()) }
/// ```
///
/// The registry covers the whole process, so in a crate of edition 2024, whose
/// doctests are compiled into one binary, two doctests that each define a `charge`
/// with a defaulted name refuse each other: give them distinct names.
///
/// # `lease = "DUR"`
///
/// How long a running claim is owned before another caller may take it over (its owner
/// is presumed crashed). Default `"60s"`. A background task renews the lease every third
/// of it for as long as the call's future is alive, so a slow but live body is not taken
/// over, and renewal stops when the future is dropped or the process dies. A body that
/// awaits forever therefore keeps its claim: bound slow calls with a timeout. Measured
/// by the store's clock. Zero is a compile error. In transactional mode (`tx`) nothing
/// renews the lease: it bounds only a claim left behind by a cancelled body (see `tx`).
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// #[idempotent(store = idem, key = month, retain = "30d", lease = "10m")]
/// async fn monthly_report(idem: &Idem, month: &str) -> Result<String, IdemError> {
///     let attempt = idem_runtime::current().epoch(); // 1 unless a lapsed claim was taken over
///     Ok(format!("report {month}, attempt {attempt}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// assert_eq!(monthly_report(&idem, "2025-01").await?, "report 2025-01, attempt 1");
/// # Ok(()) }
/// ```
///
/// # `in_flight = wait("DUR") | reject`
///
/// A duplicate that arrives while the first call is running: `wait("DUR")` waits up to
/// DUR for its outcome (default `wait("5s")`), then returns
/// `IdemError::InFlight { retry_after }`; `reject` returns `InFlight` at once (map it to
/// HTTP 409 or a delayed redelivery). `wait("0s")` is a compile error: write `reject`.
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
/// use tokio::sync::Notify;
///
/// static STARTED: Notify = Notify::const_new();
/// static FINISH: Notify = Notify::const_new();
///
/// #[idempotent(store = idem, key = job, retain = "1d", in_flight = reject)]
/// async fn export(idem: &Idem, job: u64) -> Result<String, IdemError> {
///     STARTED.notify_one();
///     FINISH.notified().await; // still running when the duplicate arrives
///     Ok(format!("export {job} done"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// let (first, duplicate) = tokio::join!(export(&idem, 7), async {
///     STARTED.notified().await;
///     let duplicate = export(&idem, 7).await;
///     FINISH.notify_one();
///     duplicate
/// });
/// assert!(matches!(duplicate, Err(IdemError::InFlight { .. })));
/// assert_eq!(first?, "export 7 done");
/// # Ok(()) }
/// ```
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
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// # #[derive(Debug, serde::Serialize, serde::Deserialize)]
/// # #[allow(dead_code)]
/// # enum PayError {
/// #     Declined,
/// #     #[serde(skip)]
/// #     Idem(IdemError),
/// # }
/// # impl From<IdemError> for PayError {
/// #     fn from(e: IdemError) -> Self { PayError::Idem(e) }
/// # }
///
/// static RUNS: AtomicUsize = AtomicUsize::new(0);
///
/// #[idempotent(store = idem, key = order_id, retain = "7d", errors = record)]
/// async fn refund_order(idem: &Idem, order_id: u64) -> Result<u64, PayError> {
///     RUNS.fetch_add(1, Ordering::SeqCst);
///     Err(PayError::Declined)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), PayError> {
/// let idem = Idem::memory();
/// assert!(matches!(refund_order(&idem, 9).await, Err(PayError::Declined)));
/// assert!(matches!(refund_order(&idem, 9).await, Err(PayError::Declined))); // replayed
/// assert_eq!(RUNS.load(Ordering::SeqCst), 1);
/// # Ok(()) }
/// ```
///
/// ```
/// use idem_runtime::{idempotent, Disposition, Idem, IdemError};
/// # #[derive(Debug, serde::Serialize, serde::Deserialize)]
/// # enum PayError {
/// #     Declined,
/// #     Timeout,
/// #     #[serde(skip)]
/// #     Idem(IdemError),
/// # }
/// # impl From<IdemError> for PayError {
/// #     fn from(e: IdemError) -> Self { PayError::Idem(e) }
/// # }
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Receipt;
/// # async fn psp_charge(order_id: u64) -> Result<Receipt, PayError> {
/// #     Err(if order_id == 1 { PayError::Declined } else { PayError::Timeout })
/// # }
///
/// fn classify(e: &PayError) -> Disposition {
///     match e {
///         PayError::Declined => Disposition::Record,  // a decline is an answer
///         PayError::Timeout => Disposition::Unknown,  // the charge may have gone through
///         _ => Disposition::Release,
///     }
/// }
///
/// #[idempotent(store = idem, key = order_id, retain = "7d", classify = classify)]
/// async fn authorize(idem: &Idem, order_id: u64) -> Result<Receipt, PayError> {
///     psp_charge(order_id).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), PayError> {
/// let idem = Idem::memory();
/// assert!(matches!(authorize(&idem, 1).await, Err(PayError::Declined)));
/// assert!(matches!(authorize(&idem, 1).await, Err(PayError::Declined))); // replayed
/// assert!(matches!(authorize(&idem, 2).await, Err(PayError::Timeout)));
/// let retry = authorize(&idem, 2).await; // not run again while the charge is in doubt
/// assert!(matches!(retry, Err(PayError::Idem(IdemError::Unknown { .. }))));
/// # Ok(()) }
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
/// ```
/// use idem_runtime::{current, idempotent, Idem, IdemError};
///
/// #[idempotent(store = idem, key = order_id, retain = "7d", on_takeover = rerun)]
/// async fn pay_invoice(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
///     // Sent to the payment provider as its idempotency key.
///     Ok(current().downstream_key("psp"))
/// }
///
/// #[idempotent(store = idem, key = user_id, retain = "7d", on_takeover = unknown)]
/// async fn send_receipt(idem: &Idem, user_id: u64) -> Result<(), IdemError> {
///     Ok(()) // a mail provider that cannot deduplicate
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// // A body that runs again (here, against a fresh store) hands the provider the same key.
/// let first = pay_invoice(&Idem::memory(), 42).await?;
/// assert_eq!(pay_invoice(&Idem::memory(), 42).await?, first);
/// send_receipt(&Idem::memory(), 7).await?;
/// # Ok(()) }
/// ```
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
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
/// # struct Mailer;
/// # impl Mailer {
/// #     async fn send(&self, _to: &str, _text: &str) -> Result<(), IdemError> { Ok(()) }
/// # }
///
/// #[idempotent(store = idem, key = to, retain = "1d")]
/// async fn welcome(
///     idem: &Idem,
///     #[idem(skip)] mailer: &Mailer, // not `Serialize`, and not part of the request
///     to: &str,
///     text: &str,
/// ) -> Result<(), IdemError> {
///     mailer.send(to, text).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// welcome(&idem, &Mailer, "ana@example.com", "Welcome, Ana").await?;
/// welcome(&idem, &Mailer, "ana@example.com", "Welcome, Ana").await?; // replayed
/// let other = welcome(&idem, &Mailer, "ana@example.com", "Hello").await;
/// assert!(matches!(other, Err(IdemError::Mismatch { .. })));
/// # Ok(()) }
/// ```
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// // Only the amount is bound to the order; the note may differ between retries.
/// #[idempotent(store = idem, key = order, retain = "7d", fingerprint = cents)]
/// async fn charge_amount(idem: &Idem, order: u64, cents: u64, note: &str) -> Result<String, IdemError> {
///     Ok(format!("{cents} charged ({note})"))
/// }
///
/// // Events are immutable upstream: their id is enough.
/// #[idempotent(store = idem, key = event_id, retain = "1d", fingerprint = none)]
/// async fn ingest(idem: &Idem, event_id: u64, payload: &str) -> Result<String, IdemError> {
///     Ok(payload.to_owned())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// assert_eq!(charge_amount(&idem, 1, 500, "first try").await?, "500 charged (first try)");
/// assert_eq!(charge_amount(&idem, 1, 500, "retry").await?, "500 charged (first try)"); // replayed
/// assert!(matches!(charge_amount(&idem, 1, 900, "retry").await, Err(IdemError::Mismatch { .. })));
/// assert_eq!(ingest(&idem, 5, "a").await?, "a");
/// assert_eq!(ingest(&idem, 5, "b").await?, "a"); // nothing bound: the first outcome
/// # Ok(()) }
/// ```
///
/// `#[idem(...)]` attributes are removed from the output.
///
/// # `tx = IDENT`
///
/// Transactional mode: `IDENT` names a parameter `tx: &mut sqlx::Transaction<'_, DB>`
/// (PostgreSQL, MySQL/MariaDB or SQLite). The claim and the record run inside the caller's transaction,
/// beside the body's own writes, and commit or roll back with them; the body runs in a
/// savepoint, so a released `Err` leaves none of its writes. The row lock is the claim
/// and rollback is the release, so `in_flight`, `on_takeover` and
/// `on_store_error = fail_open` do not apply and are compile errors here. The `tx`
/// parameter is not fingerprinted. An `Err` classified `Disposition::Unknown` is recorded
/// like `Record` here: the body's writes commit or roll back with the transaction, so
/// nothing in it is in doubt.
///
/// ```
/// use idem_runtime::{idempotent, BoxError, Idem};
/// use sqlx::{Sqlite, Transaction};
///
/// #[idempotent(store = idem, tx = tx, key = order_id, retain = "30d")]
/// async fn place_order(
///     idem: &Idem,
///     tx: &mut Transaction<'_, Sqlite>,
///     order_id: &str,
///     qty: i64,
/// ) -> Result<i64, BoxError> {
///     sqlx::query("INSERT INTO orders (id, qty) VALUES (?1, ?2)")
///         .bind(order_id)
///         .bind(qty)
///         .execute(&mut **tx)
///         .await?;
///     Ok(qty)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// // One connection: the business table, idem's table and the transactions share it.
/// let pool = sqlx::sqlite::SqlitePoolOptions::new()
///     .max_connections(1)
///     .connect("sqlite::memory:")
///     .await?;
/// sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
///     .execute(&pool)
///     .await?;
/// let idem = Idem::from_pool(pool.clone()).await?; // idem's table in the same database
/// for _ in 0..2 {
///     let mut tx = pool.begin().await?;
///     assert_eq!(place_order(&idem, &mut tx, "o-1", 3).await?, 3);
///     tx.commit().await?;
/// }
/// let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
///     .fetch_one(&pool)
///     .await?;
/// assert_eq!(orders, 1); // the second transaction replayed the outcome, writing nothing
/// # Ok(()) }
/// ```
///
/// Expands to, roughly:
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
/// `lease = "DUR"` (default `"60s"`) still applies: a transactional claim is written with
/// a lease, which matters only when the body is cancelled (its future dropped) and the
/// caller commits the transaction anyway. The claim is then committed IN_PROGRESS with
/// no body to finish it, and holds its key (duplicates are told `IdemError::InFlight`)
/// until the lease lapses; the next call then takes it over and runs the body again.
/// While the transaction is open, duplicates block on its row lock whatever the lease,
/// so a short lease never lets one in beside a running body.
///
/// ```
/// use idem_runtime::{idempotent, BoxError, Idem};
/// use sqlx::{Sqlite, Transaction};
///
/// // A claim abandoned in a committed transaction holds its key for 2 minutes, not 60 s.
/// #[idempotent(store = idem, tx = tx, key = order_id, retain = "30d", lease = "2m")]
/// async fn reserve(idem: &Idem, tx: &mut Transaction<'_, Sqlite>, order_id: &str) -> Result<(), BoxError> {
///     Ok(())
/// }
/// ```
///
/// # `on_store_error = fail_closed | fail_open`
///
/// The store is unreachable at claim time. `fail_closed` (default): the call returns
/// `Err(IdemError::Store { .. })` and the body does not run. `fail_open`: the body runs
/// unprotected and a warning event is emitted, for effects where a duplicate is cheaper
/// than an outage; but not once the store has said another call is running the
/// operation (a store error while waiting on it fails closed).
///
/// ```
/// use idem_runtime::{idempotent, BoxError, Idem, IdemError};
///
/// #[idempotent(store = idem, key = user_id, retain = "1h", on_store_error = fail_open)]
/// async fn refresh_cache(idem: &Idem, user_id: u64) -> Result<String, IdemError> {
///     Ok(format!("cache of user {user_id} refreshed"))
/// }
///
/// #[idempotent(store = idem, key = order_id, retain = "7d")]
/// async fn debit(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
///     Ok(format!("order {order_id} charged"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), BoxError> {
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// let idem = Idem::from_pool(pool.clone()).await?;
/// pool.close().await; // the store is now unreachable
/// assert_eq!(refresh_cache(&idem, 7).await?, "cache of user 7 refreshed"); // unprotected
/// assert!(matches!(debit(&idem, 1).await, Err(IdemError::Store { .. }))); // body not run
/// # Ok(()) }
/// ```
///
/// # `version = N` and `upgrade = PATH`
///
/// The outcome's schema version (default 1); bump it when `T`'s serialized form changes.
/// An outcome recorded under another version is passed to
/// `upgrade: fn(u32, serde_json::Value) -> Result<T, IdemError>` (the recorded version
/// and value) if given, and is otherwise an `IdemError::Codec` naming the operation and
/// both versions: never a panic, never a silent re-run. A recorded `Err` of another
/// version is always that `Codec` error (`upgrade` converts successes only).
///
/// ```
/// use idem_runtime::{idempotent, Idem, IdemError};
///
/// #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
/// struct Price { cents: u64, currency: String }
///
/// // Version 1 recorded a bare number of euro cents.
/// fn from_v1(version: u32, old: serde_json::Value) -> Result<Price, IdemError> {
///     assert_eq!(version, 1);
///     let cents = old.as_u64().unwrap_or_default();
///     Ok(Price { cents, currency: "EUR".into() })
/// }
///
/// #[idempotent(store = idem, key = sku, retain = "1d", name = "quote")]
/// async fn quote_v1(idem: &Idem, sku: u64) -> Result<u64, IdemError> {
///     Ok(250)
/// }
///
/// #[idempotent(
///     store = idem, key = sku, retain = "1d", name = "quote", version = 2, upgrade = from_v1
/// )]
/// async fn quote(idem: &Idem, sku: u64) -> Result<Price, IdemError> {
///     Ok(Price { cents: 300, currency: "USD".into() })
/// }
///
/// #[idempotent(store = idem, key = sku, retain = "1d", name = "quote", version = 2)]
/// async fn quote_no_upgrade(idem: &Idem, sku: u64) -> Result<Price, IdemError> {
///     Ok(Price { cents: 300, currency: "USD".into() })
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// quote_v1(&idem, 1).await?; // recorded by the previous build
/// assert_eq!(quote(&idem, 1).await?, Price { cents: 250, currency: "EUR".into() });
/// assert!(matches!(quote_no_upgrade(&idem, 1).await, Err(IdemError::Codec { .. })));
/// # Ok(()) }
/// ```
///
/// # `crate = path` or `crate = "path"`
///
/// Where `idem_runtime` is, for crates that re-export it:
/// `crate = my_framework::idem` or `crate = "my_framework::idem"`. Default
/// `::idem_runtime`.
///
/// ```
/// mod my_framework {
///     pub use idem_runtime as idem;
/// }
/// use my_framework::idem::{idempotent, Idem, IdemError};
///
/// #[idempotent(crate = my_framework::idem, store = idem, key = id, retain = "1d")]
/// async fn touch(idem: &Idem, id: u64) -> Result<u64, IdemError> {
///     Ok(id)
/// }
///
/// #[idempotent(crate = "my_framework::idem", store = idem, key = id, retain = "1d")]
/// async fn touch_quoted(idem: &Idem, id: u64) -> Result<u64, IdemError> {
///     Ok(id)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// assert_eq!(touch(&idem, 1).await? + touch_quoted(&idem, 2).await?, 3);
/// # Ok(()) }
/// ```
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
/// - a `key` of a type the client chooses (`http::IdempotencyKey`, `mcp::IdempotencyKey`,
///   or a field of that type such as `args.idempotency_key`) on an operation without
///   `scope`: another principal sending the same key would get this one's outcome. Put
///   the caller's principal in `scope`; where every caller is one principal on purpose,
///   say so with `scope = "global"`. The check is by type, so it sees through field
///   accesses and references;
/// - `retain`, `lease` or `wait` strings that do not parse, zero durations, a missing
///   `key` or `retain`, unknown or duplicate arguments, `errors` with `classify`, `tx`
///   with `in_flight`, `on_takeover` or `fail_open`, a `tx` naming no
///   parameter, a function that is not `async` or does not return `Result`, an empty
///   `name`, `version = 0`, and unknown options in a parameter's `#[idem(...)]`;
/// - `#[idempotent]` placed below rmcp's `#[tool]`, which hands it a `fn` returning a
///   pinned boxed future (or a non-async `fn` that still carries `#[tool]`): the error
///   says to put `#[idempotent]` above `#[tool]`, where it sees the `async fn` as written.
///
/// All mistakes in one attribute are reported together; the function itself is still
/// emitted beside the errors, so they are not followed by a cascade of others.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
