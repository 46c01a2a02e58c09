//! The store conformance suite: checks that any [`Store`] moves records through the
//! contract's states. Not a stable API.
//!
//! Each check takes a store and works on operation ids of its own (unique per call), so
//! the checks may share one store and run in any order. Each panics with a message
//! naming the transition that broke. A store's tests call [`run_all`]:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = idem_runtime::store::MemoryStore::default();
//! idem_runtime::store::conformance::run_all(&store).await;
//! # }
//! ```
//!
//! Transactional mode has checks of its own, run on a SQL database and its
//! transactions: `tx`.
#![allow(missing_docs)]

mod claim_counts;
mod leases;
mod operator;
mod replays;
mod steps;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub mod tx;

pub use self::claim_counts::claim_counts_allow_the_burst_then_one_an_interval;
pub use self::leases::{
    a_lease_holds_its_full_length, epochs_never_repeat, lapsed_lease_goes_unknown,
    lapsed_lease_is_taken_over_and_fenced, release_lets_the_next_call_run,
};
pub use self::operator::{
    forget_drops_settled_records_only, purge_removes_only_expired_completed,
    resolve_records_or_removes, stats_and_list,
};
pub use self::replays::{
    expired_is_claimed_afresh, fresh_claim_in_flight_then_replay, mismatch_in_every_state,
};
pub use self::steps::{
    a_new_life_starts_without_steps, a_release_keeps_steps_and_fingerprint,
    a_released_operation_expires, a_takeover_resumes_the_steps,
    an_operator_settles_a_released_operation, earlier_lives_leave_no_steps,
    steps_are_recorded_fenced_and_replaced, steps_go_with_their_operation,
    steps_of_one_operation_record_at_once, unknown_keeps_steps_and_retry_resumes,
};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Claim, ClaimRequest, OperationId, Store, StoredOutcome, Takeover};

const FP: [u8; 32] = [1; 32];
const OTHER_FP: [u8; 32] = [2; 32];
const LEASE: Duration = Duration::from_secs(60);
const TINY: Duration = Duration::from_millis(5);
/// Comfortably past [`TINY`] by any store's clock.
const PAST_TINY: Duration = Duration::from_millis(60);
const DAY: Duration = Duration::from_secs(86_400);

/// An operation id no other check (and no earlier run on a durable store) uses.
fn fresh_id(check: &str) -> OperationId {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    OperationId {
        scope: "conformance".into(),
        name: check.into(),
        key: format!("{}-{nanos}-{n}", std::process::id()),
    }
}

fn outcome(body: &str) -> StoredOutcome {
    StoredOutcome {
        is_err: false,
        version: 1,
        body: body.as_bytes().to_vec().into(),
    }
}

async fn claim_with(
    store: &dyn Store,
    id: &OperationId,
    fp: [u8; 32],
    lease: Duration,
    on_takeover: Takeover,
) -> Claim {
    let req = ClaimRequest {
        id,
        fingerprint: fp,
        lease,
        on_takeover,
    };
    store.claim(&req).await.expect("claim")
}

async fn claim(store: &dyn Store, id: &OperationId, fp: [u8; 32], lease: Duration) -> Claim {
    claim_with(store, id, fp, lease, Takeover::Rerun).await
}

/// Claims `id` afresh and returns the epoch; panics on anything but a fresh claim.
async fn acquire(store: &dyn Store, id: &OperationId, fp: [u8; 32], lease: Duration) -> u64 {
    match claim(store, id, fp, lease).await {
        Claim::Acquired {
            epoch,
            takeover: false,
            resume: false,
        } => epoch,
        other => panic!("{id}: expected a fresh claim, got {other:?}"),
    }
}

/// Every check of the suite, in turn.
pub async fn run_all(store: &dyn Store) {
    fresh_claim_in_flight_then_replay(store).await;
    mismatch_in_every_state(store).await;
    lapsed_lease_is_taken_over_and_fenced(store).await;
    lapsed_lease_goes_unknown(store).await;
    a_lease_holds_its_full_length(store).await;
    resolve_records_or_removes(store).await;
    forget_drops_settled_records_only(store).await;
    release_lets_the_next_call_run(store).await;
    expired_is_claimed_afresh(store).await;
    epochs_never_repeat(store).await;
    purge_removes_only_expired_completed(store).await;
    stats_and_list(store).await;
    steps_are_recorded_fenced_and_replaced(store).await;
    a_takeover_resumes_the_steps(store).await;
    a_release_keeps_steps_and_fingerprint(store).await;
    a_released_operation_expires(store).await;
    an_operator_settles_a_released_operation(store).await;
    unknown_keeps_steps_and_retry_resumes(store).await;
    a_new_life_starts_without_steps(store).await;
    steps_go_with_their_operation(store).await;
    earlier_lives_leave_no_steps(store).await;
    steps_of_one_operation_record_at_once(store).await;
    claim_counts_allow_the_burst_then_one_an_interval(store).await;
}
