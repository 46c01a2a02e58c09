//! What a queue consumer does with a message, given how its idempotent handler
//! answered.
//!
//! Brokers deliver at least once: after a consumer crash, a lost ack or a missed ack
//! deadline the same message comes again, and producers republish. Key the handler on
//! the message's business identity (a payment id, an order id), never on a delivery
//! sequence number, and let [`Policy::verdict`] turn its result into one of three
//! [`Action`]s, which map onto every broker's vocabulary:
//!
//! | answer | [`Cause`] | [`Action`] |
//! |---|---|---|
//! | ran and recorded (`Ok`, or an `Err` recorded with `errors = record`) | `Done` | `Ack` |
//! | replayed a recorded outcome | `Replayed` | `Ack` |
//! | in flight in another consumer | `InFlight` | `Redeliver` after `retry_after` |
//! | store down, contention, lost claim, unrecorded outcome | `StoreDown`, `Fenced`, `Unrecorded` | `Redeliver` after [`Policy::store_down`] |
//! | the body's error, released (`errors = release`) | `Released` | `Redeliver` with backoff by delivery count |
//! | same business id, other payload | `Mismatch` | `Terminate`, alert |
//! | UNKNOWN outcome: this delivery's or an earlier one's (an error classified `Unknown`, an outcome that could not be recorded); reconcile first | `Unknown` | `Terminate`, alert |
//! | a message that can never be handled (key empty or over the cap, outcome undecodable) | `Invalid` | `Terminate`, alert |
//! | no store configured, invalid configuration | `Misconfigured` | `Redeliver` after [`Policy::backoff_max`], alert |
//!
//! `Redeliver` is a negative acknowledgement with a delay (JetStream `Nak(delay)`,
//! SQS `ChangeMessageVisibility`, Pub/Sub `modifyAckDeadline`); `Terminate` stops
//! redelivery (JetStream `Term`, or a dead-letter queue) and needs a person: a
//! mismatch is a producer reusing an id, an unknown outcome waits for
//! [`Idem::resolve`](crate::Idem::resolve). A misconfigured consumer keeps its
//! messages rather than dropping them.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use idem_runtime::queue::{Action, Policy};
//! use idem_runtime::{Idem, IdemError};
//!
//! let idem = Idem::memory();
//! let handle = |payment: &'static str| {
//!     idem.operation("apply_payment", payment)
//!         .retain(std::time::Duration::from_secs(86_400))
//!         .fingerprint_none()
//!         .run(|| async { Ok::<_, IdemError>(()) })
//! };
//! let policy = Policy::default();
//! let (_, first) = policy.run(handle("p-1"), 1).await;
//! let (_, again) = policy.run(handle("p-1"), 2).await;
//! assert_eq!(first.action, Action::Ack);
//! assert_eq!(again.action, Action::Ack);
//! assert!(again.replayed());
//! # }
//! ```

use std::time::Duration;

use crate::context::{CallInfo, observe};
use crate::error::IdemError;

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
    /// The store could not be reached or refused for a transient reason; the handler
    /// did not run.
    StoreDown,
    /// This delivery's claim was taken over; the taker records the outcome.
    Fenced,
    /// The handler ran but its outcome could not be recorded; its claim lapses and a
    /// later delivery takes over.
    Unrecorded,
    /// The handler failed and its error released the claim: a later delivery runs it
    /// again.
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
    /// Whether a person should look: a terminated message, or a misconfigured consumer.
    pub fn alert(&self) -> bool {
        matches!(self.action, Action::Terminate) || self.cause == Cause::Misconfigured
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
/// redelivery horizon (see the README's "Queue consumers").
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
}

impl Default for Policy {
    /// 100 ms floor, backoff from 1 s doubling to 5 min, 5 s after a store error.
    fn default() -> Self {
        Policy {
            min_delay: Duration::from_millis(100),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            store_down: Duration::from_secs(5),
        }
    }
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
            after: after.clamp(self.min_delay, self.backoff_max.max(self.min_delay)),
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
            return verdict(redeliver(self.backoff(delivery)), Cause::Released);
        };
        match idem {
            IdemError::InFlight { retry_after, .. }
            | IdemError::TooManyWaiters { retry_after, .. } => {
                verdict(redeliver(*retry_after), Cause::InFlight)
            }
            IdemError::Store { .. } => verdict(redeliver(self.store_down), Cause::StoreDown),
            IdemError::Fenced { .. } => verdict(redeliver(self.store_down), Cause::Fenced),
            IdemError::Unrecorded { .. } => verdict(redeliver(self.store_down), Cause::Unrecorded),
            IdemError::Mismatch { .. } => verdict(Action::Terminate, Cause::Mismatch),
            // An outcome over the cap parks the operation in UNKNOWN as well.
            IdemError::Unknown { .. } | IdemError::OutcomeTooLarge { .. } => {
                verdict(Action::Terminate, Cause::Unknown)
            }
            IdemError::KeyTooLong { .. }
            | IdemError::EmptyKey { .. }
            | IdemError::ScopeTooLong { .. }
            | IdemError::BadName { .. }
            | IdemError::Codec { .. } => verdict(Action::Terminate, Cause::Invalid),
            IdemError::NoStore | IdemError::Config { .. } => {
                verdict(redeliver(self.backoff_max), Cause::Misconfigured)
            }
        }
    }

    /// The delay after a released error on the `delivery`-th delivery:
    /// `backoff_base × 2^(delivery − 1)`, at most `backoff_max`.
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
            tracing::error!(
                target: "idem::queue",
                cause = ?verdict.cause,
                action = ?verdict.action,
                delivery,
                error = %e,
                "message needs attention"
            );
        }
        (result, verdict)
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
        let p = policy();
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
