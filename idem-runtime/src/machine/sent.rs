//! Claims sent to a store that makes round trips, and what a call that goes away
//! early leaves behind: a claim in flight finished on a task of its own, and a claim
//! whose body never started released.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::bounded::{bounded, no_answer};
use crate::error::StoreError;
use crate::idem::Idem;
use crate::metrics;
use crate::store::{Claim, ClaimRequest, Fence};

/// A claim sent to the store, bounded by the store timeout from when it was sent, and
/// owned so that it can outlive the call.
///
/// Past the store timeout the claim is given up: its statement's future is dropped,
/// which closes its connection (no store reuses one mid-protocol), so a silent
/// connection frees its slot at once. A claim the store made but whose answer never came
/// has an epoch nobody knows and cannot be released: it lapses with its lease (and with
/// `on_takeover = unknown` then turns into UNKNOWN, though no body ran).
///
/// A caller that goes away before the answer (cancelled, not timed out) leaves the claim
/// to finish on a task of its own until that same deadline; a claim it made is released
/// there, since no body ran.
pub(super) struct ClaimInFlight {
    claim: Option<ClaimFuture>,
    idem: Idem,
    id: Arc<crate::store::OperationId>,
    /// The operation's retention, for the release of a claim made here that resumed
    /// steps: they are kept that long.
    retain: Duration,
    /// When the store timeout counted from the claim's sending ends.
    deadline: Instant,
}

type ClaimFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send + 'static>>;

impl ClaimInFlight {
    pub(super) fn send(
        idem: &Idem,
        id: Arc<crate::store::OperationId>,
        req: &ClaimRequest<'_>,
        retain: Duration,
        sent: Instant,
    ) -> Self {
        let (store, owned, fingerprint, lease, on_takeover) = (
            idem.store().clone(),
            id.clone(),
            req.fingerprint,
            req.lease,
            req.on_takeover,
        );
        let timeout = idem.store_timeout();
        let deadline = sent + timeout;
        let claim = Box::pin(async move {
            let req = ClaimRequest {
                id: &owned,
                fingerprint,
                lease,
                on_takeover,
            };
            let claim = metrics::store_call(&owned.name, "claim", store.claim(&req));
            tokio::time::timeout_at(deadline, claim)
                .await
                .unwrap_or_else(|_| Err(no_answer("claim", timeout)))
        });
        ClaimInFlight {
            claim: Some(claim),
            idem: idem.clone(),
            id,
            retain,
            deadline,
        }
    }
}

impl Future for ClaimInFlight {
    type Output = Result<Claim, StoreError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let claim = self
            .claim
            .as_mut()
            .expect("a claim is not polled after it answered");
        let answer = std::task::ready!(claim.as_mut().poll(cx));
        self.claim = None;
        std::task::Poll::Ready(answer)
    }
}

impl Drop for ClaimInFlight {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        if Instant::now() >= self.deadline {
            // Timed out already (an outer bound dropped it): dropped here, connection
            // and all.
            return;
        }
        let (idem, id, retain) = (self.idem.clone(), self.id.clone(), self.retain);
        spawn_cleanup(async move {
            // The claim's future ends by the deadline, answered or not.
            if let Ok(Claim::Acquired { epoch, .. }) = claim.await {
                let bound = idem.store_timeout();
                release_unstarted(&idem, &id, epoch, retain, bound).await;
            }
        });
    }
}

/// A claim this call holds whose body has not started; released if dropped armed.
pub(super) struct Unstarted<'a> {
    armed: Option<Armed<'a>>,
}

/// What an armed [`Unstarted`] releases, and how long the release waits for the store.
pub(super) struct Armed<'a> {
    pub(super) idem: &'a Idem,
    pub(super) id: &'a Arc<crate::store::OperationId>,
    pub(super) epoch: u64,
    /// The operation's retention, for steps the claim resumed: they are kept that long.
    pub(super) retain: &'a Duration,
    pub(super) bound: Duration,
}

impl<'a> Unstarted<'a> {
    /// Armed only where there is a window to cancel in: a claim made at once (the memory
    /// store's) goes straight to its body.
    pub(super) fn arm(armed: Armed<'a>, at_once: bool) -> Unstarted<'a> {
        Unstarted {
            armed: (!at_once).then_some(armed),
        }
    }

    pub(super) fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for Unstarted<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.armed.take() {
            let (idem, id, epoch, retain, bound) =
                (a.idem.clone(), a.id.clone(), a.epoch, *a.retain, a.bound);
            spawn_cleanup(async move { release_unstarted(&idem, &id, epoch, retain, bound).await });
        }
    }
}

/// Runs `cleanup` on the current runtime, if there is one: a future dropped outside a
/// runtime leaves its claim to lapse.
fn spawn_cleanup(cleanup: impl Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(cleanup);
        }
        Err(_) => tracing::warn!(
            "a cancelled call's unstarted claim cannot be released outside a Tokio runtime; \
             it lapses with its lease"
        ),
    }
}

/// Releases the claim at `epoch` whose body never ran, waiting at most `bound` for the
/// store. Steps it resumed are kept for `retain`, the operation's retention.
async fn release_unstarted(
    idem: &Idem,
    id: &crate::store::OperationId,
    epoch: u64,
    retain: Duration,
    bound: Duration,
) {
    let release = metrics::store_call(&id.name, "release", idem.store().release(id, epoch, retain));
    match bounded(bound, "release", release).await {
        Ok(Fence::Held) => {
            tracing::debug!(
                epoch,
                "released a cancelled call's claim; its body never ran"
            );
            idem.wake(id);
        }
        Ok(Fence::Lost) => {}
        Err(e) => tracing::warn!(
            epoch,
            error = %e,
            "could not release a cancelled call's unstarted claim; it lapses with its lease"
        ),
    }
}
