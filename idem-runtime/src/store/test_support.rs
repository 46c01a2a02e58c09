//! What the stores' own tests share (the SQL dialects', the memory store's).

use std::time::Duration;

use super::{Claim, ClaimRequest, OperationId, Store, StoredOutcome, Takeover};

pub(crate) const FP: [u8; 32] = [1; 32];
pub(crate) const OTHER_FP: [u8; 32] = [2; 32];
pub(crate) const LEASE: Duration = Duration::from_secs(60);
pub(crate) const DAY: Duration = Duration::from_secs(86_400);

pub(crate) fn op(key: &str) -> OperationId {
    OperationId {
        scope: "tenant".into(),
        name: "charge".into(),
        key: key.into(),
    }
}

pub(crate) fn req<'a>(
    id: &'a OperationId,
    fingerprint: [u8; 32],
    lease: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        id,
        fingerprint,
        lease,
        on_takeover: Takeover::Rerun,
    }
}

pub(crate) fn outcome(body: &str) -> StoredOutcome {
    StoredOutcome {
        is_err: false,
        version: 1,
        body: body.as_bytes().to_vec().into(),
    }
}

pub(crate) async fn claim(
    store: &dyn Store,
    id: &OperationId,
    fp: [u8; 32],
    lease: Duration,
) -> Claim {
    store.claim(&req(id, fp, lease)).await.expect("claim")
}

pub(crate) fn epoch_of(claim: Claim) -> u64 {
    match claim {
        Claim::Acquired { epoch, .. } => epoch,
        other => panic!("expected a claim, got {other:?}"),
    }
}
