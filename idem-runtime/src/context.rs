//! What a running body can learn about its operation, and what a caller can learn
//! about a finished call.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::sync::Arc;

use crate::step_state::{StepsMode, StepsRun};
use crate::store::OperationId;

tokio::task_local! {
    static BODY: Body;
    static OBSERVED: Cell<Option<CallInfo>>;
    /// Where a handler layer that accepts long requests learns which operation its
    /// handler claimed or found in flight (`IdempotentHandlerLayer::accept_after`).
    static WATCHED: Watched;
    /// The step whose closure is running. A scope of its own (not a field of `Body`) so
    /// that steps joined concurrently each see their own label; it names the body it
    /// belongs to, so a body nested in a step's closure sees none.
    static STEP: StepScope;
}

/// The step whose closure is running, as the client layers read it.
#[derive(Default)]
pub(crate) struct StepScope {
    /// The body whose step this is (`body_mark`).
    body: usize,
    label: Option<Arc<str>>,
    /// How many keyed calls this run of the step has made (`client`).
    calls: Cell<u32>,
}

impl StepScope {
    /// The step's label; `None` outside a step.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) fn label(&self) -> Option<&Arc<str>> {
        self.label.as_ref()
    }

    /// The ordinal of the step's next keyed call: 0, 1, 2, ... within one run of it.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) fn next_call(&self) -> u32 {
        let n = self.calls.get();
        self.calls.set(n.saturating_add(1));
        n
    }
}

/// Runs `f` on the running step's scope (the empty scope outside a step), or returns
/// `None` outside a body.
#[cfg_attr(not(feature = "client"), allow(dead_code))]
pub(crate) fn with_step<R>(f: impl FnOnce(&StepScope) -> R) -> Option<R> {
    let body = with_body(body_mark)?;
    let mut f = Some(f);
    let in_step = STEP.try_with(|s| {
        let f = f.take().filter(|_| s.body == body)?;
        Some(f(s))
    });
    match in_step {
        Ok(Some(r)) => Some(r),
        _ => f.map(|f| f(&StepScope::default())),
    }
}

/// What tells one running body from another: its identity's allocation, live for as
/// long as the body runs.
fn body_mark(body: &Body) -> usize {
    Arc::as_ptr(&body.current.id) as usize
}

/// Runs `fut`, a step's closure, with the step's label visible to [`with_step`].
pub(crate) async fn in_step<F: Future>(label: &str, fut: F) -> F::Output {
    let scope = StepScope {
        body: with_body(body_mark).unwrap_or_default(),
        label: Some(label.into()),
        calls: Cell::new(0),
    };
    STEP.scope(scope, fut).await
}

/// What a running body sees: its operation, and the state of its steps.
pub(crate) struct Body {
    pub(crate) current: Current,
    pub(crate) steps: StepsMode,
    /// Made at the first step: a body without steps carries one pointer for it.
    pub(crate) run: RefCell<Option<Box<StepsRun>>>,
    /// Per `(method, path)` of the keyed calls made outside steps, how many this run of
    /// the body has made (`client`); empty until the first, and fresh on every run.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) calls: RefCell<Vec<(Box<str>, u32)>>,
}

impl Body {
    /// The ordinal of this run's next keyed call to `endpoint` (`"POST /charges"`): 0,
    /// 1, 2, ... per endpoint.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) fn next_call(&self, endpoint: &str) -> u32 {
        let mut calls = self.calls.borrow_mut();
        if let Some((_, n)) = calls.iter_mut().find(|(e, _)| &**e == endpoint) {
            let this = *n;
            *n = n.saturating_add(1);
            return this;
        }
        calls.push((endpoint.into(), 1));
        0
    }
}

/// Runs `f` on the running body's context, or returns `None` outside a body.
pub(crate) fn with_body<R>(f: impl FnOnce(&Body) -> R) -> Option<R> {
    BODY.try_with(f).ok()
}

/// The operation whose body is running, as [`current`] returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Current {
    /// Shared with the lease's renewals: one copy of the identity per running call.
    id: Arc<OperationId>,
    epoch: u64,
    /// The running step's label, when [`current`] was called inside one.
    step: Option<Arc<str>>,
}

impl Current {
    /// The encoded scope.
    pub fn scope(&self) -> &str {
        &self.id.scope
    }

    /// The operation's name.
    pub fn name(&self) -> &str {
        &self.id.name
    }

    /// The encoded key.
    pub fn key(&self) -> &str {
        &self.id.key
    }

    /// The epoch of this attempt: the fence that identifies this claim. Epochs come from
    /// the store: a counter shared by every operation of the table (SQL stores) or of
    /// the store (memory), or the server's clock in microseconds (Redis). So the first
    /// attempt's epoch is any positive number, not 1; a takeover's is always higher than
    /// the claim it took over, and no epoch repeats for an operation's recorded or
    /// leased attempts. (In transactional mode on SQLite the counter is in the caller's
    /// transaction: an attempt that rolled back leaves no trace, its epoch included, so
    /// the next attempt may see the same number.) A body run unprotected under
    /// `fail_open` sees 0. Use it to tell attempts apart in logs, not as an attempt
    /// count; [`downstream_key`](Self::downstream_key) does not depend on it.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A key for a downstream system (a payment provider's `Idempotency-Key`, a
    /// message id), derived from the operation's identity and `label`.
    ///
    /// It is the same on every retry and takeover of this operation, so the
    /// downstream system deduplicates an effect that a crashed attempt already made.
    /// Different labels give independent keys for several calls in one body.
    pub fn downstream_key(&self, label: &str) -> String {
        self.id.downstream_key(label)
    }

    /// The label of the [step](crate::step) whose closure called [`current`], or `None`
    /// outside a step. The client layers (feature `client`) key a step's first call by
    /// it, so `current().downstream_key(label)` with this label is the key they send.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::IdemError> {
    /// use idem_runtime::{Idem, IdemError, current, step};
    /// let idem = Idem::memory();
    /// idem.operation("checkout", "order-1")
    ///     .retain(std::time::Duration::from_secs(3600))
    ///     .fingerprint_none()
    ///     .run(|| async {
    ///         assert_eq!(current().step(), None);
    ///         step("charge", || async {
    ///             assert_eq!(current().step(), Some("charge"));
    ///             Ok::<_, IdemError>(())
    ///         })
    ///         .await
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn step(&self) -> Option<&str> {
        self.step.as_deref()
    }

    pub(crate) fn shared_id(&self) -> Arc<OperationId> {
        self.id.clone()
    }
}

/// The running operation.
///
/// # Panics
/// Outside the body of an idempotent call, like `tokio::runtime::Handle::current`.
/// The context is not visible in tasks the body spawns. Use [`try_current`] where
/// that may happen.
pub fn current() -> Current {
    try_current().expect(
        "idem_runtime::current() called outside an idempotent body; \
         use try_current() where the call may happen elsewhere",
    )
}

/// The running operation, or `None` outside an idempotent body.
pub fn try_current() -> Option<Current> {
    with_body(|b| {
        let mut current = b.current.clone();
        current.step = with_step(|s| s.label.clone()).flatten();
        current
    })
}

/// Runs a body with its context, and tells whether one of its steps ran without being
/// recorded (so releasing the claim would run that effect again).
pub(crate) async fn scope_body<F: Future>(
    id: Arc<OperationId>,
    epoch: u64,
    steps: StepsMode,
    fut: F,
) -> (F::Output, bool) {
    let body = Body {
        current: Current {
            id,
            epoch,
            step: None,
        },
        steps,
        run: RefCell::default(),
        calls: RefCell::default(),
    };
    // A fresh observe slot: idempotent calls nested in the body must not report
    // themselves as the outer call. (Nor is a body nested in a step's closure in that
    // step: the step's scope names its own body.)
    BODY.scope(
        body,
        OBSERVED.scope(Cell::new(None), async move {
            let out = fut.await;
            let doubt = BODY.with(|b| b.run.borrow().as_ref().is_some_and(|r| r.unrecorded()));
            (out, doubt)
        }),
    )
    .await
}

/// The operation a watched handler's first idempotent call is about: the `Idem` it ran
/// on, its identity and retention.
#[derive(Clone)]
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
pub(crate) struct Watch {
    pub(crate) idem: crate::Idem,
    pub(crate) id: Arc<OperationId>,
    pub(crate) retain: std::time::Duration,
}

/// A handler's [`Watch`], once its first idempotent call claimed or met its operation.
pub(crate) type Watched = Arc<std::sync::Mutex<Option<Watch>>>;

/// Runs `fut` with `slot` told of the first operation an idempotent call in it claims
/// or finds in flight.
#[cfg(feature = "axum")]
pub(crate) async fn watch<F: Future>(slot: Watched, fut: F) -> F::Output {
    WATCHED.scope(slot, fut).await
}

/// Tells a watching handler layer, if any, which operation this call is about (the
/// first call only: later and nested ones are not the request's).
pub(crate) fn report_operation(
    idem: &crate::Idem,
    id: impl FnOnce() -> Arc<OperationId>,
    retain: std::time::Duration,
) {
    let _ = WATCHED.try_with(|slot| {
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(Watch {
                idem: idem.clone(),
                id: id(),
                retain,
            });
        }
    });
}

/// How an idempotent call was answered, as [`observe`] reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallInfo {
    replayed: bool,
    epoch: Option<u64>,
    recorded: bool,
    unknown: bool,
}

impl CallInfo {
    /// Whether the result is a recorded outcome, replayed without running the body.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The epoch that ran the body, when this call ran it.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// Whether the result, `Ok` or `Err`, is a recorded outcome: replayed, or run and
    /// recorded by this call. `false` for an error that released the claim (the next
    /// call runs the body again) and for a call that failed before a decision.
    pub fn recorded(&self) -> bool {
        self.recorded
    }

    /// Whether this call ran the body and left its outcome unknown: the body's error
    /// was classified [`Disposition::Unknown`](crate::Disposition::Unknown), or its
    /// result could not be recorded (it does not serialize, or is over the outcome
    /// cap). The operation is then UNKNOWN, and later calls get
    /// [`IdemError::Unknown`](crate::IdemError::Unknown) until it is resolved.
    pub fn unknown(&self) -> bool {
        self.unknown
    }
}

pub(crate) fn report(info: CallInfo) {
    let _ = OBSERVED.try_with(|slot| slot.set(Some(info)));
}

pub(crate) fn report_replay() {
    report(CallInfo {
        replayed: true,
        epoch: None,
        recorded: true,
        unknown: false,
    });
}

pub(crate) fn report_run(epoch: u64, recorded: bool) {
    report(CallInfo {
        replayed: false,
        epoch: Some(epoch),
        recorded,
        unknown: false,
    });
}

/// The body ran (epoch `epoch`) and its outcome was neither recorded nor released.
pub(crate) fn report_unknown(epoch: u64) {
    report(CallInfo {
        replayed: false,
        epoch: Some(epoch),
        recorded: false,
        unknown: true,
    });
}

/// Runs `fut` (a call of an idempotent function) and tells whether its result was
/// replayed. When `fut` made no idempotent call, or failed before one was decided,
/// the `CallInfo` is the default (not replayed, no epoch).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::IdemError> {
/// use idem_runtime::{observe, Idem, IdemError};
/// let idem = Idem::memory();
/// let call = || idem.operation("greet", "k1")
///     .retain(std::time::Duration::from_secs(86_400))
///     .fingerprint_none()
///     .run(|| async { Ok::<_, IdemError>(1) });
/// let (_, first) = observe(call()).await;
/// let (_, again) = observe(call()).await;
/// assert!(!first.replayed() && again.replayed());
/// # Ok(()) }
/// ```
pub async fn observe<F: Future>(fut: F) -> (F::Output, CallInfo) {
    OBSERVED
        .scope(Cell::new(None), async move {
            let out = fut.await;
            let info = OBSERVED.with(|slot| slot.get()).unwrap_or_default();
            (out, info)
        })
        .await
}
