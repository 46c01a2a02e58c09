//! Stores that answer in this process, without a round trip: a claim and a record taken
//! at once on the caller's thread, and a replay shared rather than copied. The state
//! machine asks every store for this through [`Store::at_once`](super::Store::at_once);
//! the memory store answers, wrappers and remote stores do not. Its types are public
//! only to appear in that method, and cannot be named outside the crate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Claim, ClaimRequest, Fence, OperationId, OutcomeRef, StoredOutcome};

/// Claims and records answered at once, in this process.
pub trait AtOnce: Send + Sync {
    /// Claims on this thread: a completed outcome comes back shared, with the instant
    /// the lease runs from. With `pin`, an acquired claim is held for as long as its
    /// call lives rather than renewed; the call must [`unpin`](Self::unpin) it if it
    /// ends unsettled.
    fn claim_at_once(&self, req: &ClaimRequest<'_>, pin: bool) -> (Claimed, Instant);

    /// Records `outcome` at once, keeping it as it is.
    fn record_at_once(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: Kept,
        retain: Duration,
    ) -> Fence;

    /// A pinned claim's call ended without settling it: its lease runs from now.
    fn unpin(&self, id: &OperationId, epoch: u64);
}

/// What a claim taken at once decided.
pub enum Claimed {
    Decided(Claim),
    /// Completed for this fingerprint: the recorded outcome, shared.
    Completed(Kept),
}

/// A recorded outcome as this store keeps it: the body in one allocation shared with
/// the replays that read it, so a replay copies nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    is_err: bool,
    version: u32,
    body: Arc<[u8]>,
}

impl Kept {
    pub(crate) fn view(&self) -> OutcomeRef<'_> {
        OutcomeRef {
            is_err: self.is_err,
            version: self.version,
            body: &self.body,
        }
    }

    pub(crate) fn stored(&self) -> StoredOutcome {
        StoredOutcome {
            is_err: self.is_err,
            version: self.version,
            body: self.body.to_vec(),
        }
    }
}

impl From<&StoredOutcome> for Kept {
    /// The body copied once, into the shared allocation.
    fn from(o: &StoredOutcome) -> Kept {
        Kept {
            is_err: o.is_err,
            version: o.version,
            body: Arc::from(o.body.as_slice()),
        }
    }
}
