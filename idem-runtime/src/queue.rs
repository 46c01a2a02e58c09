//! What a queue consumer does with a message, given how its idempotent handler
//! answered.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use idem_runtime::queue::{Action, Policy};
//! use idem_runtime::{Idem, IdemError};
//!
//! let idem = Idem::memory();
//! // Keyed on the message's business identity, never on its delivery sequence.
//! let apply_payment = |payment_id: &'static str| {
//!     idem.operation("apply_payment", payment_id)
//!         .retain(std::time::Duration::from_secs(7 * 86_400))
//!         .fingerprint_none()
//!         .run(|| async { Ok::<_, IdemError>(()) })
//! };
//! let policy = Policy::default();
//! let (_, first) = policy.run(apply_payment("p-1"), 1).await;
//! let (_, redelivered) = policy.run(apply_payment("p-1"), 2).await;
//! assert_eq!(first.action, Action::Ack);
//! assert_eq!(redelivered.action, Action::Ack);
//! assert!(redelivered.replayed()); // the handler did not run again
//! # }
//! ```
//!
//! Brokers deliver at least once: after a consumer crash, a lost ack or a missed ack
//! deadline the same message comes again, and producers republish. Key the handler on
//! the message's business identity (a payment id, an order id), never on a delivery
//! sequence number, and let [`Policy::run`] (or [`Policy::verdict`]) turn its result into
//! one of three [`Action`]s, which map onto every broker's vocabulary. This module
//! depends on no broker and needs no feature.
//!
//! | answer | [`Cause`] | [`Action`] |
//! |---|---|---|
//! | ran and recorded (`Ok`, or an `Err` recorded with `errors = record`) | `Done` | `Ack` |
//! | replayed a recorded outcome | `Replayed` | `Ack` |
//! | in flight in another consumer | `InFlight` | `Redeliver` after `retry_after` (at least [`Policy::min_delay`]) |
//! | over the caller's allowance of new claims ([`IdemBuilder::limit_new_claims`](crate::IdemBuilder::limit_new_claims)) | `RateLimited` | `Redeliver` after `retry_after` plus a random delay up to the delivery's backoff |
//! | store down, contention, lost claim, unrecorded outcome | `StoreDown`, `Fenced`, `Unrecorded` | `Redeliver` after a random delay up to [`Policy::store_down`] |
//! | the body's error, released (`errors = release`), or a transactional handler's outcome over the cap (its writes rolled back) | `Released` | `Redeliver` after a random delay up to `backoff_base × 2^(delivery−1)`, at most `backoff_max` |
//! | the handler panicked ([`Policy::run_batch`]) | `Panicked` | `Redeliver` as for a released error, and alert |
//! | same business id, other payload | `Mismatch` | `Terminate`, alert |
//! | UNKNOWN outcome: this delivery's or an earlier one's (an error classified `Unknown`, an outcome that could not be recorded); reconcile first | `Unknown` | `Terminate`, alert |
//! | a message that can never be handled (key empty or over the cap, outcome undecodable, an encrypted outcome that fails to open) | `Invalid` | `Terminate`, alert |
//! | no store configured, invalid configuration, an encrypted outcome under a key the keyring lacks | `Misconfigured` | `Redeliver` after [`Policy::backoff_max`], alert |
//!
//! `Redeliver` is a negative acknowledgement with a delay (JetStream `Nak(delay)`,
//! SQS `ChangeMessageVisibility`, Pub/Sub `modifyAckDeadline`); `Terminate` stops
//! redelivery (JetStream `Term`, or a dead-letter queue) and needs a person: a
//! mismatch is a producer reusing an id, an unknown outcome waits for
//! [`Idem::resolve`](crate::Idem::resolve). A misconfigured consumer keeps its
//! messages rather than dropping them. [`Policy::run`] logs every alert as an error
//! event (target `idem::queue`).
//!
//! # Jitter
//!
//! Consumers that failed together (a store outage, a downstream error hitting a whole
//! batch) would retry together, and fail together again. So the delay after a released
//! error or a store error is drawn at random ("full jitter") between
//! [`Policy::min_delay`] and its ceiling: [`Policy::backoff`] for the delivery, or
//! [`Policy::store_down`]. The in-flight delay is not jittered: it is the running claim's
//! remaining lease, the earliest a redelivery can learn anything. Set
//! [`Policy::jitter`] to `false` for delays a test can predict.
//!
//! # Batches
//!
//! Pull consumers fetch messages in batches (JetStream `fetch`, SQS `ReceiveMessage`,
//! Kafka polls), and each message needs its own answer: SQS calls this partial batch
//! failure. [`Policy::run_batch`] runs the handler over every message of a batch
//! concurrently and returns one verdict per message. Each message is its own idempotent
//! operation, so one message's error, mismatch or panic changes no other message's
//! verdict, and a redelivered batch replays the messages that were done.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use idem_runtime::queue::{Action, AsIdemError, Cause, Policy};
//! use idem_runtime::{Idem, IdemError};
//!
//! #[derive(Debug, thiserror::Error)]
//! enum PayError {
//!     #[error("the ledger is busy")]
//!     Busy,
//!     #[error(transparent)]
//!     Idem(#[from] IdemError),
//! }
//! impl AsIdemError for PayError {
//!     fn as_idem_error(&self) -> Option<&IdemError> {
//!         match self { PayError::Idem(e) => Some(e), PayError::Busy => None }
//!     }
//! }
//!
//! let idem = Idem::memory();
//! // (payment id, amount, delivery count), as the broker handed them over.
//! let batch = [("p-1", 100, 1), ("p-2", 200, 1), ("p-3", 300, 1)];
//! let handled = Policy::default()
//!     .run_batch(&batch, |m| m.2, |&(id, amount, _)| {
//!         idem.operation("apply_payment", id)
//!             .retain(std::time::Duration::from_secs(7 * 86_400))
//!             .fingerprint(&amount)
//!             .run(move || async move {
//!                 if id == "p-2" {
//!                     return Err(PayError::Busy); // released: p-2 runs again later
//!                 }
//!                 Ok(amount)
//!             })
//!     })
//!     .await;
//! let causes: Vec<Cause> = handled.iter().map(|h| h.verdict.cause).collect();
//! assert_eq!(causes, [Cause::Done, Cause::Released, Cause::Done]);
//! assert!(matches!(handled[1].verdict.action, Action::Redeliver { .. }));
//! # }
//! ```
//!
//! # Ack after the record
//!
//! Ack only once the outcome is recorded. With the effect in your own database, run
//! the handler in [transactional mode](crate::guide::transactions) and ack after the
//! commit: a crash between the two then replays instead of applying twice. With
//! JetStream:
//!
//! ```text
//! let (result, verdict) = Policy::default().run(apply_payment(&idem, &mut tx, &msg), delivery).await;
//! match verdict.action {
//!     Action::Ack => msg.double_ack().await?,                      // after the commit
//!     Action::Redeliver { after } => msg.ack_with(AckKind::Nak(Some(after))).await?,
//!     Action::Terminate => msg.ack_with(AckKind::Term).await?,    // and alert a person
//! }
//! ```
//!
//! # Sizing `retain`
//!
//! A duplicate must find the record still there, so size `retain` from the broker's
//! redelivery horizon: the longest of the redelivery schedule (`max_deliver` times the
//! ack wait or the largest backoff step), the producer's retry window, and how long a
//! dead-letter queue may hold a message before someone replays it (often days).
//! JetStream's `Nats-Msg-Id` deduplication covers only its publish window (2 minutes by
//! default) and never a redelivery to a consumer.
//!
//! # Publishing once
//!
//! A body that publishes (a consumer's follow-up event, a service's notification) and
//! is run again after a crash publishes again. JetStream drops a message whose
//! `Nats-Msg-Id` it has seen within the stream's duplicate window, so publish with
//! [`message_id`]`(label)`, the operation's downstream key for `label`: the same on every
//! run of the operation, so the re-run's copy is dropped and the stream holds one
//! message. Size the stream's `duplicate_window` (2 minutes by default) to cover a
//! re-run: at least the lease, plus how long the caller waits before it retries.
//!
//! ```text
//! let mut headers = async_nats::HeaderMap::new();
//! headers.insert(MSG_ID_HEADER, message_id("shipped")?.as_str());
//! js.publish_with_headers(subject, headers, payload).await?.await?; // ack: stored or a duplicate
//! ```
//!
//! # A complete consumer
//!
//! The workspace's `examples/queue_consumer.rs` is a JetStream pull consumer (durable,
//! explicit ack) of `{"payment_id", "amount_cents"}` messages, writing one `payments` row
//! per payment in transactional mode on SQLite (or PostgreSQL). Its test runs it as a
//! child process against a real server: 500 payments with 10% republished, the consumer
//! killed with SIGKILL mid-run and restarted, leave exactly 500 rows and nothing pending.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use crate::context::{CallInfo, observe};
use crate::error::{IdemError, OpenFailure};

/// What the consumer does with the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Acknowledge: the message's effect is recorded (by this delivery or an earlier one).
    Ack,
    /// Negative-acknowledge and have the broker deliver it again after `after`.
    Redeliver {
        /// How long the broker should wait.
        after: Duration,
    },
    /// Stop redelivering (terminate, or move to a dead-letter queue) and alert.
    Terminate,
}

/// Why the [`Action`] was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cause {
    /// The handler ran and its outcome is recorded.
    Done,
    /// A recorded outcome was replayed; the handler did not run.
    Replayed,
    /// Another consumer is running the handler for this business id.
    InFlight,
    /// The message would start a new operation and its caller is over its allowance of
    /// new claims ([`IdemBuilder::limit_new_claims`](crate::IdemBuilder::limit_new_claims));
    /// the handler did not run.
    RateLimited,
    /// The store could not be reached or refused for a transient reason; the handler
    /// did not run.
    StoreDown,
    /// This delivery's claim was taken over; the taker records the outcome.
    Fenced,
    /// The handler ran but its outcome could not be recorded; its claim lapses and a
    /// later delivery takes over.
    Unrecorded,
    /// The handler failed and its error released the claim (or, in a transaction, its
    /// outcome was over the cap and its writes were rolled back with the claim): a later
    /// delivery runs it again.
    Released,
    /// The business id was first used with another payload.
    Mismatch,
    /// This attempt's or an earlier one's effect is unknown (an error classified
    /// `Unknown`, an outcome that could not be recorded); reconcile, then resolve the
    /// operation.
    Unknown,
    /// The message can never be handled as it is.
    Invalid,
    /// No store, or an invalid configuration: a deployment fault, not the message's.
    Misconfigured,
    /// The handler panicked ([`Policy::run_batch`]). If its body had started, the claim
    /// stays in progress until its lease lapses, and a later delivery takes it over.
    Panicked,
}

/// An [`Action`] and its [`Cause`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// What to do with the message.
    pub action: Action,
    /// Why.
    pub cause: Cause,
}

impl Verdict {
    /// Whether a person should look: a terminated message, a misconfigured consumer, or
    /// a handler that panicked.
    pub fn alert(&self) -> bool {
        matches!(self.action, Action::Terminate)
            || matches!(self.cause, Cause::Misconfigured | Cause::Panicked)
    }

    /// Whether the handler's result was a replayed recorded outcome.
    pub fn replayed(&self) -> bool {
        self.cause == Cause::Replayed
    }
}

/// Finds idem's own error inside a handler's error type, so a consumer can tell
/// idem's answers (in flight, mismatch, …) from the body's failures.
///
/// Implement it for the handler's error type, which holds an `IdemError` variant
/// because `#[idempotent]` needs `E: From<IdemError>`:
///
/// ```
/// use idem_runtime::IdemError;
/// use idem_runtime::queue::AsIdemError;
///
/// #[derive(Debug)]
/// enum PaymentError { Declined, Idem(IdemError) }
///
/// impl From<IdemError> for PaymentError {
///     fn from(e: IdemError) -> Self { PaymentError::Idem(e) }
/// }
///
/// impl AsIdemError for PaymentError {
///     fn as_idem_error(&self) -> Option<&IdemError> {
///         match self { PaymentError::Idem(e) => Some(e), _ => None }
///     }
/// }
/// ```
pub trait AsIdemError {
    /// idem's error, when this is one.
    fn as_idem_error(&self) -> Option<&IdemError>;
}

impl AsIdemError for IdemError {
    fn as_idem_error(&self) -> Option<&IdemError> {
        Some(self)
    }
}

/// Delays for redelivery. Size the handler's `retain` to outlast the broker's whole
/// redelivery horizon (see [the module docs](self#sizing-retain)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The shortest delay before a redelivery; also the floor under an in-flight
    /// `retry_after`, so a lease about to lapse does not cause a tight loop.
    pub min_delay: Duration,
    /// The delay after the first released error; it doubles with each delivery.
    pub backoff_base: Duration,
    /// The longest delay.
    pub backoff_max: Duration,
    /// The delay after a store error, a lost claim or an unrecorded outcome.
    pub store_down: Duration,
    /// Whether the delays after a released error and after a store error are drawn at
    /// random between [`min_delay`](Self::min_delay) and their ceiling (see
    /// [Jitter](self#jitter)), so consumers that failed together do not retry together.
    /// `false` makes them the ceilings themselves, for tests.
    pub jitter: bool,
}

impl Default for Policy {
    /// 100 ms floor, backoff from 1 s doubling to 5 min, 5 s after a store error,
    /// jittered.
    fn default() -> Self {
        Policy {
            min_delay: Duration::from_millis(100),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            store_down: Duration::from_secs(5),
            jitter: true,
        }
    }
}

/// One message's answer from [`Policy::run_batch`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Handled<T, E> {
    /// What the handler returned; `None` when it panicked.
    pub result: Option<Result<T, E>>,
    /// What to do with the message.
    pub verdict: Verdict,
}

impl Policy {
    /// The verdict on a handler's `result`, as [`observe`] described the call (`info`),
    /// for the `delivery`-th delivery of the message (1 for the first; JetStream's
    /// `info().delivered`).
    pub fn verdict<T, E: AsIdemError>(
        &self,
        result: &Result<T, E>,
        info: CallInfo,
        delivery: u64,
    ) -> Verdict {
        let verdict = |action, cause| Verdict { action, cause };
        let redeliver = |after: Duration| Action::Redeliver {
            after: self.clamp(after),
        };
        let jittered = |ceiling: Duration| Action::Redeliver {
            after: self.jittered(ceiling),
        };
        let done = |info: CallInfo| {
            let cause = if info.replayed() {
                Cause::Replayed
            } else {
                Cause::Done
            };
            verdict(Action::Ack, cause)
        };
        let err = match result {
            // Also a body run unprotected (fail_open), or no idempotent call at all.
            Ok(_) => return done(info),
            Err(e) => e,
        };
        // The handler ran and left the operation UNKNOWN, whatever the error: a
        // redelivery would only be refused until someone reconciles it.
        if info.unknown() {
            return verdict(Action::Terminate, Cause::Unknown);
        }
        let Some(idem) = err.as_idem_error() else {
            // The body's own error: final when it was recorded (`errors = record`).
            if info.recorded() {
                return done(info);
            }
            return verdict(jittered(self.backoff(delivery)), Cause::Released);
        };
        match idem {
            IdemError::InFlight { retry_after, .. }
            | IdemError::TooManyWaiters { retry_after, .. } => {
                verdict(redeliver(*retry_after), Cause::InFlight)
            }
            // Spread over a backoff past the allowance's next room: a backlog of one
            // caller's messages redelivered at one instant would be refused together.
            IdemError::RateLimited { retry_after, .. } => verdict(
                redeliver(*retry_after + self.jittered(self.backoff(delivery))),
                Cause::RateLimited,
            ),
            IdemError::Store { .. } => verdict(jittered(self.store_down), Cause::StoreDown),
            IdemError::Fenced { .. } => verdict(jittered(self.store_down), Cause::Fenced),
            IdemError::Unrecorded { .. } => verdict(jittered(self.store_down), Cause::Unrecorded),
            IdemError::Mismatch { .. } => verdict(Action::Terminate, Cause::Mismatch),
            // An outcome over the cap outside a transaction parks the operation in
            // UNKNOWN as well.
            IdemError::Unknown { .. } | IdemError::OutcomeTooLarge { in_doubt: true, .. } => {
                verdict(Action::Terminate, Cause::Unknown)
            }
            // In a transaction its writes were rolled back with the claim: released.
            IdemError::OutcomeTooLarge { .. } => {
                verdict(jittered(self.backoff(delivery)), Cause::Released)
            }
            IdemError::KeyTooLong { .. }
            | IdemError::EmptyKey { .. }
            | IdemError::ScopeTooLong { .. }
            | IdemError::BadName { .. }
            | IdemError::Codec { .. }
            | IdemError::Undecryptable {
                reason: OpenFailure::Unauthentic | OpenFailure::Malformed,
                ..
            } => verdict(Action::Terminate, Cause::Invalid),
            // A record sealed under a key this keyring lacks: the deployment's fault.
            IdemError::NoStore
            | IdemError::Config { .. }
            | IdemError::Undecryptable {
                reason: OpenFailure::UnknownKey | OpenFailure::NoKeyring,
                ..
            } => verdict(redeliver(self.backoff_max), Cause::Misconfigured),
        }
    }

    /// `after` within `[min_delay, backoff_max]` (`min_delay` wins if they cross).
    fn clamp(&self, after: Duration) -> Duration {
        after.clamp(self.min_delay, self.backoff_max.max(self.min_delay))
    }

    /// A delay drawn uniformly from `[min_delay, ceiling]` (both clamped as every delay
    /// is), or the clamped ceiling itself without [`jitter`](Self::jitter).
    fn jittered(&self, ceiling: Duration) -> Duration {
        let ceiling = self.clamp(ceiling);
        if !self.jitter || ceiling <= self.min_delay {
            return ceiling;
        }
        let floor = self.min_delay.as_nanos() as u64;
        let top = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(fastrand::u64(floor..=top))
    }

    /// Delays drawn exactly, without jitter: the ceilings the verdicts would otherwise
    /// draw below.
    ///
    /// ```
    /// use idem_runtime::queue::Policy;
    /// let policy = Policy::default().without_jitter();
    /// assert!(!policy.jitter);
    /// ```
    pub fn without_jitter(self) -> Self {
        Policy {
            jitter: false,
            ..self
        }
    }

    /// The ceiling of the delay after a released error on the `delivery`-th delivery:
    /// `backoff_base × 2^(delivery − 1)`, at most `backoff_max`. With
    /// [`jitter`](Self::jitter) (the default) the verdict's delay is drawn between
    /// [`min_delay`](Self::min_delay) and this; without, it is this.
    pub fn backoff(&self, delivery: u64) -> Duration {
        let doublings = delivery.saturating_sub(1).min(32) as u32;
        self.backoff_base
            .saturating_mul(1u32 << doublings.min(31))
            .min(self.backoff_max)
    }

    /// Runs `handler` (a call of an idempotent function) and returns its result with the
    /// verdict for the `delivery`-th delivery. A verdict that needs a person is also
    /// logged as an error event (target `idem::queue`).
    pub async fn run<F, T, E>(&self, handler: F, delivery: u64) -> (Result<T, E>, Verdict)
    where
        F: Future<Output = Result<T, E>>,
        E: AsIdemError + std::fmt::Display,
    {
        let (result, info) = observe(handler).await;
        let verdict = self.verdict(&result, info, delivery);
        if let (true, Err(e)) = (verdict.alert(), &result) {
            alert(&verdict, delivery, e);
        }
        (result, verdict)
    }

    /// Runs `handler` over every message of a batch, concurrently in the calling task,
    /// and returns each message's result and verdict, in the order of `messages`:
    /// SQS-style partial batch failure, where each message is acked, redelivered or
    /// terminated on its own. `delivery` gives a message's delivery count (1 for the
    /// first; JetStream's `info().delivered`).
    ///
    /// Each call of `handler` is its own operation, keyed on its message's business
    /// identity: one message's error, mismatch or panic does not change another's
    /// verdict. A panicking handler gets [`Cause::Panicked`], redelivered after the
    /// released-error backoff and alerted (a build with `panic = "abort"` stops the
    /// process instead). Verdicts that need a person are logged as [`run`](Self::run)
    /// logs them. See [Batches](self#batches).
    pub async fn run_batch<'m, M, D, H, F, T, E>(
        &self,
        messages: &'m [M],
        delivery: D,
        handler: H,
    ) -> Vec<Handled<T, E>>
    where
        D: Fn(&M) -> u64,
        H: Fn(&'m M) -> F,
        F: Future<Output = Result<T, E>>,
        E: AsIdemError + std::fmt::Display,
    {
        use std::panic::{AssertUnwindSafe, catch_unwind};
        // Each message's call, until it answers; then its answer (`None`: it panicked).
        // Generic rather than boxed as `dyn Future`, so the batch is `Send` whenever the
        // handler's futures are, and runs in a spawned task.
        enum Slot<C, O> {
            Running(Pin<Box<C>>),
            Answered(Option<O>),
        }
        let mut slots: Vec<Slot<_, _>> = messages
            .iter()
            .map(|m| match catch_unwind(AssertUnwindSafe(|| handler(m))) {
                Ok(call) => Slot::Running(Box::pin(observe(call))),
                Err(panic) => {
                    panic_event(&*panic);
                    Slot::Answered(None)
                }
            })
            .collect();
        std::future::poll_fn(|cx| {
            let mut running = false;
            for slot in &mut slots {
                let Slot::Running(call) = slot else { continue };
                match catch_unwind(AssertUnwindSafe(|| call.as_mut().poll(cx))) {
                    Ok(Poll::Ready(answer)) => *slot = Slot::Answered(Some(answer)),
                    Ok(Poll::Pending) => running = true,
                    Err(panic) => {
                        panic_event(&*panic);
                        *slot = Slot::Answered(None);
                    }
                }
            }
            if running {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
        slots
            .into_iter()
            .zip(messages)
            .map(|(slot, message)| {
                let delivery = delivery(message);
                let Slot::Answered(answer) = slot else {
                    unreachable!("every call answered before the batch ends")
                };
                match answer {
                    Some((result, info)) => {
                        let verdict = self.verdict(&result, info, delivery);
                        if let (true, Err(e)) = (verdict.alert(), &result) {
                            alert(&verdict, delivery, e);
                        }
                        Handled {
                            result: Some(result),
                            verdict,
                        }
                    }
                    None => {
                        let verdict = Verdict {
                            action: Action::Redeliver {
                                after: self.jittered(self.backoff(delivery)),
                            },
                            cause: Cause::Panicked,
                        };
                        alert(&verdict, delivery, &"the handler panicked");
                        Handled {
                            result: None,
                            verdict,
                        }
                    }
                }
            })
            .collect()
    }
}

/// Logs a verdict that needs a person.
fn alert(verdict: &Verdict, delivery: u64, error: &dyn std::fmt::Display) {
    tracing::error!(
        target: "idem::queue",
        cause = ?verdict.cause,
        action = ?verdict.action,
        delivery,
        error = %error,
        "message needs attention"
    );
}

/// Logs what a handler panicked with.
fn panic_event(panic: &(dyn std::any::Any + Send)) {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a non-string payload");
    tracing::error!(target: "idem::queue", panic = what, "a message handler panicked");
}

/// The header JetStream deduplicates publishes by: `Nats-Msg-Id`.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Inside an idempotent body, the message id of the publish labelled `label`, for
/// [`MSG_ID_HEADER`]: [`current()`](crate::current)`.downstream_key(label)`, the same on
/// every retry, resume and takeover of the operation, so JetStream keeps one copy of a
/// message that a re-run publishes again (within the stream's duplicate window; see
/// "Publishing once" in the [module](self) docs). Give each message of one operation
/// its own label (`"shipped"`, `format!("line:{n}")`).
///
/// # Errors
///
/// [`IdemError::Config`] outside an idempotent body (no operation to key by; the
/// context is not visible in tasks the body spawns) and for an empty label.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::IdemError> {
/// use idem_runtime::queue::message_id;
/// use idem_runtime::{Idem, IdemError, current};
///
/// let idem = Idem::memory();
/// idem.operation("ship", "order-1")
///     .retain(std::time::Duration::from_secs(86_400))
///     .fingerprint_none()
///     .run(|| async {
///         let id = message_id("shipped")?;
///         assert_eq!(id, current().downstream_key("shipped"));
///         // headers.insert(MSG_ID_HEADER, id.as_str()); js.publish_with_headers(..)
///         Ok::<_, IdemError>(())
///     })
///     .await?;
/// assert!(message_id("shipped").is_err()); // outside a body
/// # Ok(()) }
/// ```
pub fn message_id(label: &str) -> Result<String, IdemError> {
    let config = |message: String| IdemError::Config { message };
    if label.is_empty() {
        return Err(config(
            "queue::message_id needs a label naming the message within the operation \
             (\"shipped\", \"line:{n}\")"
                .into(),
        ));
    }
    match crate::context::try_current() {
        Some(current) => Ok(current.downstream_key(label)),
        None => Err(config(format!(
            "queue::message_id({label:?}) called outside an idempotent body; call it in the \
             body that publishes (not in a task the body spawned), so a re-run of the \
             operation publishes with the same id"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Idem, IdemError};

    fn policy() -> Policy {
        Policy::default()
    }

    #[derive(Debug, thiserror::Error)]
    enum HandlerError {
        #[error("declined")]
        Declined,
        #[error(transparent)]
        Idem(#[from] IdemError),
    }

    impl AsIdemError for HandlerError {
        fn as_idem_error(&self) -> Option<&IdemError> {
            match self {
                HandlerError::Idem(e) => Some(e),
                HandlerError::Declined => None,
            }
        }
    }

    async fn pay(idem: &Idem, id: &str, amount: u64, fail: bool) -> Result<u64, HandlerError> {
        idem.operation("pay", id)
            .fingerprint(&amount)
            .retain(std::time::Duration::from_secs(86_400))
            .run(|| async move {
                if fail {
                    Err(HandlerError::Declined)
                } else {
                    Ok(amount)
                }
            })
            .await
    }

    #[tokio::test]
    async fn done_then_replayed_are_acked() {
        let idem = Idem::memory();
        let (r, v) = policy().run(pay(&idem, "p1", 5, false), 1).await;
        assert_eq!(
            (r.unwrap(), v.action, v.cause),
            (5, Action::Ack, Cause::Done)
        );
        let (r, v) = policy().run(pay(&idem, "p1", 5, false), 2).await;
        assert_eq!(
            (r.unwrap(), v.action, v.cause),
            (5, Action::Ack, Cause::Replayed)
        );
        assert!(!v.alert());
    }

    #[tokio::test]
    async fn mismatch_terminates_with_alert() {
        let idem = Idem::memory();
        policy().run(pay(&idem, "p1", 5, false), 1).await.0.unwrap();
        let (_, v) = policy().run(pay(&idem, "p1", 6, false), 1).await;
        assert_eq!((v.action, v.cause), (Action::Terminate, Cause::Mismatch));
        assert!(v.alert());
    }

    #[tokio::test]
    async fn released_error_backs_off_then_runs_again() {
        let idem = Idem::memory();
        let p = policy().without_jitter();
        let (_, v) = p.run(pay(&idem, "p1", 5, true), 3).await;
        assert_eq!(v.cause, Cause::Released);
        assert_eq!(
            v.action,
            Action::Redeliver {
                after: Duration::from_secs(4)
            }
        );
        let (r, v) = p.run(pay(&idem, "p1", 5, false), 4).await;
        assert_eq!((r.unwrap(), v.cause), (5, Cause::Done));
    }

    #[tokio::test]
    async fn recorded_error_is_acked() {
        #[derive(Debug, serde::Serialize, serde::Deserialize, thiserror::Error)]
        #[error("{0}")]
        struct Rejected(String);
        impl From<IdemError> for Rejected {
            fn from(e: IdemError) -> Self {
                Rejected(e.to_string())
            }
        }
        impl AsIdemError for Rejected {
            fn as_idem_error(&self) -> Option<&IdemError> {
                None
            }
        }
        let idem = Idem::memory();
        let call = || {
            idem.operation("pay", "p9")
                .record_errors()
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async { Err::<u8, _>(Rejected("card blocked".into())) })
        };
        let (_, v) = policy().run(call(), 1).await;
        assert_eq!((v.action, v.cause), (Action::Ack, Cause::Done));
        let (_, v) = policy().run(call(), 2).await;
        assert_eq!((v.action, v.cause), (Action::Ack, Cause::Replayed));
    }

    #[tokio::test]
    async fn in_flight_redelivers_after_the_lease() {
        let idem = Idem::memory();
        let (hold, release) = tokio::sync::oneshot::channel::<()>();
        let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
        let runner = {
            let idem = idem.clone();
            tokio::spawn(async move {
                idem.operation("pay", "p1")
                    .fingerprint(&5u64)
                    .lease(Duration::from_secs(30))
                    .retain(std::time::Duration::from_secs(86_400))
                    .run(|| async move {
                        let _ = started_tx.send(());
                        let _ = release.await;
                        Ok::<_, HandlerError>(5u64)
                    })
                    .await
            })
        };
        started.await.unwrap();
        let call = idem
            .operation("pay", "p1")
            .fingerprint(&5u64)
            .in_flight(crate::InFlight::Reject)
            .retain(std::time::Duration::from_secs(86_400))
            .run(|| async { Ok::<_, HandlerError>(5u64) });
        let (_, v) = policy().run(call, 1).await;
        assert_eq!(v.cause, Cause::InFlight);
        match v.action {
            Action::Redeliver { after } => {
                assert!(after > Duration::from_secs(1) && after <= Duration::from_secs(30))
            }
            other => panic!("expected a redelivery, got {other:?}"),
        }
        hold.send(()).unwrap();
        runner.await.unwrap().unwrap();
    }

    /// A message over its producer's allowance of new claims comes back once the
    /// allowance has room, not sooner, spread past it; its handler did not run.
    #[tokio::test]
    async fn a_message_over_the_claim_limit_redelivers_after_the_allowance() {
        let every = Duration::from_secs(60);
        let idem = Idem::builder()
            .limit_new_claims(crate::ClaimLimit::new(1, every))
            .memory();
        let handle = |key: &'static str| {
            idem.operation("pay", key)
                .scope("producer-1")
                .fingerprint_none()
                .retain(Duration::from_secs(86_400))
                .run(|| async { Ok::<_, HandlerError>(5u64) })
        };
        let (_, first) = policy().run(handle("p1"), 1).await;
        assert_eq!(first.action, Action::Ack);
        let (out, v) = policy().run(handle("p2"), 1).await;
        assert!(out.is_err());
        assert_eq!(v.cause, Cause::RateLimited);
        match v.action {
            Action::Redeliver { after } => assert!(
                after > every - Duration::from_secs(5) && after <= every + policy().backoff(1),
                "{after:?}"
            ),
            other => panic!("expected a redelivery, got {other:?}"),
        }
    }

    /// Verdicts for one delivery spread between the floor and the ceiling, so consumers
    /// that failed together do not retry together; without jitter they are the ceiling.
    #[test]
    fn released_and_store_delays_are_jittered_within_floor_and_ceiling() {
        let p = policy();
        let declined = Err::<(), _>(HandlerError::Declined);
        let down = Err::<(), _>(HandlerError::Idem(IdemError::Store {
            during: "claim",
            retryable: true,
            source: "down".into(),
        }));
        for (result, delivery, ceiling) in [
            (&declined, 4, p.backoff(4)),
            (&declined, 1, p.backoff(1)),
            (&down, 1, p.store_down),
        ] {
            let delays: Vec<Duration> = (0..200)
                .map(
                    |_| match p.verdict(result, CallInfo::default(), delivery).action {
                        Action::Redeliver { after } => after,
                        other => panic!("expected a redelivery, got {other:?}"),
                    },
                )
                .collect();
            assert!(
                delays.iter().all(|d| (p.min_delay..=ceiling).contains(d)),
                "outside [{:?}, {ceiling:?}]: {delays:?}",
                p.min_delay
            );
            let distinct: std::collections::BTreeSet<_> = delays.iter().collect();
            assert!(
                distinct.len() > 100,
                "{} distinct delays of 200",
                distinct.len()
            );
            let exact = p.without_jitter();
            let fixed = exact.verdict(result, CallInfo::default(), delivery).action;
            assert_eq!(fixed, Action::Redeliver { after: ceiling });
        }
    }

    /// A batch's messages run concurrently; one message's panic and another's error
    /// leave the other verdicts as they would be alone.
    #[tokio::test]
    async fn a_batch_answers_each_message_on_its_own() {
        let idem = Idem::memory();
        pay(&idem, "p3", 30, false).await.unwrap();
        let (gate, open) = tokio::sync::watch::channel(false);
        let batch = [
            ("p1", 10u64),
            ("p2", 20),
            ("p3", 31),
            ("p4", 40),
            ("p5", 50),
        ];
        let handled = policy()
            .run_batch(
                &batch,
                |_| 1,
                |&(id, amount)| {
                    let idem = idem.clone();
                    let (gate, mut open) = (gate.clone(), open.clone());
                    async move {
                        match id {
                            "p2" => pay(&idem, id, amount, true).await,
                            "p4" => panic!("handler bug"),
                            // p1 waits for p5: they run at once, not one after the other.
                            "p1" => {
                                open.wait_for(|o| *o).await.unwrap();
                                pay(&idem, id, amount, false).await
                            }
                            "p5" => {
                                gate.send(true).unwrap();
                                pay(&idem, id, amount, false).await
                            }
                            _ => pay(&idem, id, amount, false).await,
                        }
                    }
                },
            )
            .await;
        let causes: Vec<Cause> = handled.iter().map(|h| h.verdict.cause).collect();
        assert_eq!(
            causes,
            [
                Cause::Done,
                Cause::Released,
                Cause::Mismatch,
                Cause::Panicked,
                Cause::Done
            ]
        );
        assert!(handled[3].result.is_none() && handled[3].verdict.alert());
        assert!(matches!(
            handled[3].verdict.action,
            Action::Redeliver { .. }
        ));
        assert_eq!(handled[0].result.as_ref().unwrap().as_ref().unwrap(), &10);
    }

    /// A batch of `Send` handlers is itself `Send`: it can run in a spawned task.
    #[tokio::test]
    async fn a_batch_runs_in_a_spawned_task() {
        let idem = Idem::memory();
        let handled = tokio::spawn(async move {
            let batch = vec![("p1", 1u64), ("p2", 2)];
            let idem = &idem;
            policy()
                .run_batch(&batch, |_| 1, |&(id, n)| pay(idem, id, n, false))
                .await
        })
        .await
        .unwrap();
        assert!(handled.iter().all(|h| h.verdict.action == Action::Ack));
    }

    #[test]
    fn backoff_doubles_and_saturates() {
        let p = policy();
        assert_eq!(p.backoff(0), Duration::from_secs(1));
        assert_eq!(p.backoff(1), Duration::from_secs(1));
        assert_eq!(p.backoff(2), Duration::from_secs(2));
        assert_eq!(p.backoff(9), Duration::from_secs(256));
        assert_eq!(p.backoff(10), Duration::from_secs(300));
        assert_eq!(p.backoff(u64::MAX), Duration::from_secs(300));
    }

    #[test]
    fn every_idem_error_has_a_verdict() {
        let p = policy();
        let verdict = |e: IdemError| p.verdict::<(), _>(&Err(e), CallInfo::default(), 1);
        let name = || "op".to_string();
        let cases = [
            (IdemError::NoStore, Cause::Misconfigured),
            (
                IdemError::RateLimited {
                    name: name(),
                    retry_after: Duration::from_secs(2),
                },
                Cause::RateLimited,
            ),
            (
                IdemError::Config {
                    message: String::new(),
                },
                Cause::Misconfigured,
            ),
            (
                IdemError::Unknown {
                    name: name(),
                    epoch: 2,
                },
                Cause::Unknown,
            ),
            (
                IdemError::Fenced {
                    name: name(),
                    epoch: 2,
                },
                Cause::Fenced,
            ),
            (
                IdemError::KeyTooLong {
                    name: name(),
                    len: 9,
                    max: 1,
                },
                Cause::Invalid,
            ),
            (
                IdemError::Store {
                    during: "claim",
                    retryable: true,
                    source: "down".into(),
                },
                Cause::StoreDown,
            ),
            // A keyring missing the record's key: redelivered once it has it.
            (
                IdemError::Undecryptable {
                    name: name(),
                    key_id: "k1".into(),
                    reason: OpenFailure::UnknownKey,
                },
                Cause::Misconfigured,
            ),
            // A record no key opens: no redelivery can read it.
            (
                IdemError::Undecryptable {
                    name: name(),
                    key_id: "k1".into(),
                    reason: OpenFailure::Unauthentic,
                },
                Cause::Invalid,
            ),
        ];
        for (e, cause) in cases {
            let v = verdict(e);
            assert_eq!(v.cause, cause);
            // Nothing but a message's own fault terminates it.
            let terminates = matches!(cause, Cause::Unknown | Cause::Invalid | Cause::Mismatch);
            assert_eq!(v.action == Action::Terminate, terminates, "{cause:?}");
        }
    }
}
