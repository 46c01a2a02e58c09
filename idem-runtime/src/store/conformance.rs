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

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{
    Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, State, Store, StoredOutcome,
    Takeover,
};

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

/// Every check below, in turn.
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
}

/// The labels of `id`'s recorded steps, oldest first, with their epochs and values.
async fn step_list(store: &dyn Store, id: &OperationId) -> Vec<(String, u64, String)> {
    store
        .steps(id)
        .await
        .expect("steps")
        .into_iter()
        .map(|s| {
            assert!(
                s.age < DAY,
                "a step's age is by the store's clock: {:?}",
                s.age
            );
            let body = String::from_utf8(s.outcome.body.to_vec()).expect("utf-8 value");
            (s.label, s.epoch, body)
        })
        .collect()
}

async fn put_step(store: &dyn Store, id: &OperationId, epoch: u64, label: &str, v: &str) -> Fence {
    store
        .record_step(id, epoch, label, &outcome(v))
        .await
        .expect("record_step")
}

fn step(label: &str, epoch: u64, v: &str) -> (String, u64, String) {
    (label.to_owned(), epoch, v.to_owned())
}

/// Claims `id` with `fp`, expecting an acquisition that resumes recorded steps.
async fn resume(store: &dyn Store, id: &OperationId, fp: [u8; 32], on: Takeover) -> (u64, bool) {
    match claim_with(store, id, fp, LEASE, on).await {
        Claim::Acquired {
            epoch,
            takeover,
            resume: true,
        } => (epoch, takeover),
        other => panic!("{id}: expected a claim that resumes its steps, got {other:?}"),
    }
}

/// A step is recorded under its claim's epoch, oldest first; recording a label again
/// replaces it (a retry whose reply was lost); a step of an epoch that does not hold
/// the claim, or of a completed operation, is fenced.
pub async fn steps_are_recorded_fenced_and_replaced(store: &dyn Store) {
    let id = fresh_id("steps");
    assert!(
        step_list(store, &id).await.is_empty(),
        "no record, no steps"
    );
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert!(step_list(store, &id).await.is_empty());
    assert_eq!(
        put_step(store, &id, epoch, "reserve", "\"hold-1\"").await,
        Fence::Held
    );
    assert_eq!(
        put_step(store, &id, epoch, "charge", "42").await,
        Fence::Held
    );
    assert_eq!(
        put_step(store, &id, epoch, "charge", "42").await,
        Fence::Held
    );
    assert_eq!(
        step_list(store, &id).await,
        [
            step("reserve", epoch, "\"hold-1\""),
            step("charge", epoch, "42")
        ],
        "steps are listed oldest first, a label once"
    );
    assert_eq!(
        put_step(store, &id, epoch + 1_000_000, "x", "1").await,
        Fence::Lost,
        "a step of another epoch must be fenced"
    );
    let other = fresh_id("steps");
    assert_eq!(
        put_step(store, &other, epoch, "x", "1").await,
        Fence::Lost,
        "no record"
    );
    store.record(&id, epoch, &outcome("7"), DAY).await.unwrap();
    assert_eq!(
        put_step(store, &id, epoch, "late", "1").await,
        Fence::Lost,
        "a step of a completed operation must be fenced"
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(outcome("7"))
    );
}

/// A lapsed claim with steps is taken over with `resume`; the old epoch can no longer
/// record a step, the new one adds to the steps the old one made.
pub async fn a_takeover_resumes_the_steps(store: &dyn Store) {
    let id = fresh_id("steps-takeover");
    let old = acquire(store, &id, FP, TINY).await;
    assert_eq!(put_step(store, &id, old, "charge", "1").await, Fence::Held);
    tokio::time::sleep(PAST_TINY).await;
    let (new, takeover) = resume(store, &id, FP, Takeover::Rerun).await;
    assert!(
        takeover && new > old,
        "a takeover at a higher epoch: {new} over {old}"
    );
    assert_eq!(put_step(store, &id, old, "receipt", "2").await, Fence::Lost);
    assert_eq!(put_step(store, &id, new, "receipt", "3").await, Fence::Held);
    assert_eq!(
        step_list(store, &id).await,
        [step("charge", old, "1"), step("receipt", new, "3")]
    );

    // Without steps, a takeover has nothing to resume.
    let bare = fresh_id("steps-takeover");
    acquire(store, &bare, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    match claim(store, &bare, FP, LEASE).await {
        Claim::Acquired {
            takeover: true,
            resume: false,
            ..
        } => {}
        other => panic!("a takeover without steps resumes nothing, got {other:?}"),
    }
}

/// A release with steps keeps the record, its fingerprint and its steps: another
/// request is a mismatch, and the same one resumes at once at a higher epoch, even
/// under `on_takeover = unknown` (the release was no crash). The released epoch can no
/// longer record.
pub async fn a_release_keeps_steps_and_fingerprint(store: &dyn Store) {
    let id = fresh_id("steps-release");
    let first = acquire(store, &id, FP, LEASE).await;
    assert_eq!(
        put_step(store, &id, first, "charge", "1").await,
        Fence::Held
    );
    assert_eq!(store.release(&id, first, DAY).await.unwrap(), Fence::Held);
    assert_eq!(
        claim(store, &id, OTHER_FP, LEASE).await,
        Claim::Mismatch,
        "released steps keep the request bound"
    );
    if let Ok(Some(detail)) = store.get(&id).await {
        assert_eq!(detail.info.state, State::InProgress);
        assert_eq!(
            detail.lease_remaining,
            Some(Duration::ZERO),
            "released: no lease"
        );
    }
    assert_eq!(put_step(store, &id, first, "late", "1").await, Fence::Lost);
    let (second, takeover) = resume(store, &id, FP, Takeover::Unknown).await;
    assert!(
        !takeover && second > first,
        "{second} over {first}, not a takeover"
    );
    assert!(
        matches!(claim(store, &id, FP, LEASE).await, Claim::InFlight { .. }),
        "the resumed claim holds a lease"
    );
    assert_eq!(step_list(store, &id).await, [step("charge", first, "1")]);
    assert_eq!(store.release(&id, first, DAY).await.unwrap(), Fence::Lost);
    assert_eq!(
        store.record(&id, second, &outcome("9"), DAY).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(outcome("9"))
    );
}

/// A release with steps keeps the record for the retention it is given, counted from
/// the release: within it the same request resumes and another is a mismatch, and the
/// record is neither purged nor counted as a claim in progress. Past it the record is
/// expired, as a completed one past its retention is: purged with its steps, and
/// claimed afresh, without them, by any request.
pub async fn a_released_operation_expires(store: &dyn Store) {
    let released = |id: &OperationId, retain: Duration| {
        let id = id.clone();
        async move {
            let epoch = acquire(store, &id, FP, LEASE).await;
            assert_eq!(
                put_step(store, &id, epoch, "charge", "1").await,
                Fence::Held
            );
            let before = store.stats().await.unwrap();
            assert_eq!(
                store.release(&id, epoch, retain).await.unwrap(),
                Fence::Held
            );
            let after = store.stats().await.unwrap();
            assert_eq!(
                (after.in_progress, after.released),
                (before.in_progress - 1, before.released + 1),
                "{id}: a released record is counted as released, not as a claim in progress"
            );
            epoch
        }
    };

    let kept = fresh_id("steps-release-kept");
    let first = released(&kept, DAY).await;
    let purged = fresh_id("steps-release-expired");
    released(&purged, TINY).await;
    let reclaimed = fresh_id("steps-release-expired");
    released(&reclaimed, TINY).await;
    let resumed = fresh_id("steps-release-expired");
    released(&resumed, TINY).await;
    tokio::time::sleep(PAST_TINY).await;

    // Past its retention, any request claims it afresh: another one...
    acquire(store, &reclaimed, OTHER_FP, LEASE).await;
    assert!(
        step_list(store, &reclaimed).await.is_empty(),
        "an expired record's steps are gone"
    );
    // ... and the same one, which does not resume.
    acquire(store, &resumed, FP, LEASE).await;
    assert!(step_list(store, &resumed).await.is_empty());

    let gone = store.purge_expired().await.unwrap();
    assert!(gone >= 1, "purge removes an expired released record");
    if let Ok(found) = store.get(&purged).await {
        assert_eq!(found, None, "purged");
    }
    assert!(step_list(store, &purged).await.is_empty());
    acquire(store, &purged, OTHER_FP, LEASE).await;

    // Within its retention it survived the purge, bound to its request.
    assert_eq!(claim(store, &kept, OTHER_FP, LEASE).await, Claim::Mismatch);
    if let Ok(Some(detail)) = store.get(&kept).await {
        let left = detail.expires_in.expect("a released record expires");
        assert!(left > LEASE && left <= DAY, "{left:?} of {DAY:?}");
    }
    let (second, _) = resume(store, &kept, FP, Takeover::Rerun).await;
    assert_eq!(step_list(store, &kept).await, [step("charge", first, "1")]);
    if let Ok(Some(detail)) = store.get(&kept).await {
        assert_eq!(detail.expires_in, None, "a resumed claim has no expiry");
    }
    // A resumed claim released again is kept for its retention from the new release.
    assert_eq!(
        store.release(&kept, second, TINY).await.unwrap(),
        Fence::Held
    );
    tokio::time::sleep(PAST_TINY).await;
    acquire(store, &kept, OTHER_FP, LEASE).await;
    assert!(step_list(store, &kept).await.is_empty());
}

/// A released operation's epoch no longer holds its claim: its record, renewal and move
/// to UNKNOWN are fenced. An operator may still settle it at that epoch: a retry keeps
/// it released, a completion records the outcome, and `forget` drops it.
pub async fn an_operator_settles_a_released_operation(store: &dyn Store) {
    let id = fresh_id("steps-settle");
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert_eq!(
        put_step(store, &id, epoch, "charge", "1").await,
        Fence::Held
    );
    assert_eq!(store.release(&id, epoch, DAY).await.unwrap(), Fence::Held);
    assert_eq!(
        store.record(&id, epoch, &outcome("2"), DAY).await.unwrap(),
        Fence::Lost
    );
    assert_eq!(store.renew(&id, epoch, LEASE).await.unwrap(), Fence::Lost);
    assert_eq!(store.mark_unknown(&id, epoch).await.unwrap(), Fence::Lost);
    assert_eq!(store.resolve(&id, epoch, None).await.unwrap(), Fence::Held);
    assert_eq!(
        claim(store, &id, OTHER_FP, LEASE).await,
        Claim::Mismatch,
        "still bound"
    );
    assert_eq!(step_list(store, &id).await, [step("charge", epoch, "1")]);
    let done = Some((&outcome("3"), DAY));
    assert_eq!(store.resolve(&id, epoch, done).await.unwrap(), Fence::Held);
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(outcome("3"))
    );

    let dropped = fresh_id("steps-settle");
    let epoch = acquire(store, &dropped, FP, LEASE).await;
    assert_eq!(
        put_step(store, &dropped, epoch, "charge", "1").await,
        Fence::Held
    );
    assert_eq!(
        store.release(&dropped, epoch, DAY).await.unwrap(),
        Fence::Held
    );
    if let Ok(fence) = store.forget(&dropped, epoch).await {
        assert_eq!(fence, Fence::Held, "a released operation can be forgotten");
        assert!(step_list(store, &dropped).await.is_empty());
        acquire(store, &dropped, OTHER_FP, LEASE).await;
    }
}

/// A lapsed claim with steps moved to UNKNOWN keeps them for the operator;
/// `resolve(.., None)` (retry) keeps them and the fingerprint, and the next claim
/// resumes.
pub async fn unknown_keeps_steps_and_retry_resumes(store: &dyn Store) {
    let id = fresh_id("steps-unknown");
    let epoch = acquire(store, &id, FP, TINY).await;
    assert_eq!(
        put_step(store, &id, epoch, "charge", "1").await,
        Fence::Held
    );
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(
        claim_with(store, &id, FP, LEASE, Takeover::Unknown).await,
        Claim::Unknown { epoch, now: true }
    );
    assert_eq!(step_list(store, &id).await, [step("charge", epoch, "1")]);
    assert_eq!(put_step(store, &id, epoch, "late", "1").await, Fence::Lost);
    assert_eq!(store.resolve(&id, epoch, None).await.unwrap(), Fence::Held);
    assert_eq!(claim(store, &id, OTHER_FP, LEASE).await, Claim::Mismatch);
    let (next, _) = resume(store, &id, FP, Takeover::Unknown).await;
    assert!(next > epoch);
    assert_eq!(step_list(store, &id).await, [step("charge", epoch, "1")]);
}

/// A record that completed and expired is claimed afresh without its old steps: they
/// are not listed, not resumed, and a new step starts a list of its own.
pub async fn a_new_life_starts_without_steps(store: &dyn Store) {
    let id = fresh_id("steps-life");
    let first = acquire(store, &id, FP, LEASE).await;
    assert_eq!(
        put_step(store, &id, first, "charge", "1").await,
        Fence::Held
    );
    assert_eq!(
        put_step(store, &id, first, "receipt", "2").await,
        Fence::Held
    );
    store.record(&id, first, &outcome("3"), TINY).await.unwrap();
    tokio::time::sleep(PAST_TINY).await;
    let second = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(
        step_list(store, &id).await.is_empty(),
        "a new life has no steps"
    );
    assert_eq!(
        put_step(store, &id, second, "charge", "4").await,
        Fence::Held
    );
    assert_eq!(step_list(store, &id).await, [step("charge", second, "4")]);
}

/// Steps go with their operation: when it is forgotten, and when a resolve completes
/// it and it is purged.
pub async fn steps_go_with_their_operation(store: &dyn Store) {
    let id = fresh_id("steps-gone");
    let epoch = acquire(store, &id, FP, TINY).await;
    assert_eq!(
        put_step(store, &id, epoch, "charge", "1").await,
        Fence::Held
    );
    tokio::time::sleep(PAST_TINY).await;
    claim_with(store, &id, FP, LEASE, Takeover::Unknown).await;
    if let Ok(fence) = store.forget(&id, epoch).await {
        assert_eq!(fence, Fence::Held, "UNKNOWN can be forgotten");
        assert!(
            step_list(store, &id).await.is_empty(),
            "forgotten with its record"
        );
        acquire(store, &id, FP, LEASE).await;
        assert!(step_list(store, &id).await.is_empty());
    }

    let resolved = fresh_id("steps-gone");
    let epoch = acquire(store, &resolved, FP, LEASE).await;
    assert_eq!(
        put_step(store, &resolved, epoch, "charge", "1").await,
        Fence::Held
    );
    assert_eq!(
        store.mark_unknown(&resolved, epoch).await.unwrap(),
        Fence::Held
    );
    let done = Some((&outcome("5"), TINY));
    assert_eq!(
        store.resolve(&resolved, epoch, done).await.unwrap(),
        Fence::Held
    );
    tokio::time::sleep(PAST_TINY).await;
    assert!(store.purge_expired().await.unwrap() >= 1);
    assert!(store.get(&resolved).await.map_or(true, |d| d.is_none()));
    assert!(
        step_list(store, &resolved).await.is_empty(),
        "purged with its record"
    );
}

/// Claims `id` afresh, by the same request, after a life with two steps (`a`, `b`) that
/// completed and expired, and returns the new life's epoch; it lists no steps.
async fn a_second_life(store: &dyn Store, id: &OperationId) -> u64 {
    let first = acquire(store, id, FP, LEASE).await;
    for label in ["a", "b"] {
        assert_eq!(put_step(store, id, first, label, "1").await, Fence::Held);
    }
    assert_eq!(
        store.record(id, first, &outcome("2"), TINY).await.unwrap(),
        Fence::Held
    );
    tokio::time::sleep(PAST_TINY).await;
    // Panics unless the claim is fresh: no takeover, nothing to resume.
    let epoch = acquire(store, id, FP, LEASE).await;
    assert!(
        step_list(store, id).await.is_empty(),
        "{id}: a record claimed afresh after it expired lists its earlier life's steps"
    );
    epoch
}

/// After `id`'s record went (by `how`), the next life is claimed afresh by another
/// request and lists only the step it records: nothing of an earlier life comes back.
async fn the_next_life_starts_clean(store: &dyn Store, id: &OperationId, how: &str) {
    let epoch = match claim(store, id, OTHER_FP, LEASE).await {
        Claim::Acquired {
            epoch,
            takeover: false,
            resume: false,
        } => epoch,
        other => {
            panic!("{id}: after {how}, a fresh claim by another request expected, got {other:?}")
        }
    };
    assert!(
        step_list(store, id).await.is_empty(),
        "{id}: after {how}, a new life lists an earlier life's steps"
    );
    assert_eq!(put_step(store, id, epoch, "c", "9").await, Fence::Held);
    assert_eq!(
        step_list(store, id).await,
        [step("c", epoch, "9")],
        "{id}: after {how}, the first step of a new life brought an earlier life's steps back"
    );
}

/// The steps of an earlier life never come back (the first step of a new life starts a
/// list of its own: `a_new_life_starts_without_steps`). A record that completed with
/// steps and expired is claimed afresh with none listed; however its new life ends
/// without steps of its own (a release, an operator's retry, a completion purged) the
/// record goes, earlier steps and all, and the next life lists only its own steps. A
/// record released with its steps that expired is purged with them, or claimed afresh
/// without them.
pub async fn earlier_lives_leave_no_steps(store: &dyn Store) {
    // However a new life without steps of its own ends, its record goes, the earlier
    // life's steps with it.
    for how in ["a release", "an operator's retry", "a purge"] {
        let id = fresh_id("steps-earlier-life");
        let epoch = a_second_life(store, &id).await;
        let fence = match how {
            "a release" => store.release(&id, epoch, LEASE).await,
            "an operator's retry" => store.resolve(&id, epoch, None).await,
            _ => store.record(&id, epoch, &outcome("4"), TINY).await,
        };
        assert_eq!(fence.unwrap(), Fence::Held, "{id}: {how} of a new life");
        if how == "a purge" {
            tokio::time::sleep(PAST_TINY).await;
            assert!(
                store.purge_expired().await.unwrap() >= 1,
                "purge removes an expired completion"
            );
        }
        if let Ok(found) = store.get(&id).await {
            assert_eq!(
                found, None,
                "{id}: {how} of a life without steps of its own kept the record for an \
                 earlier life's steps"
            );
        }
        the_next_life_starts_clean(store, &id, how).await;
    }

    // Released with its steps and expired: purged with them, or claimed afresh and rid
    // of them by the first step of its new life.
    let expired = fresh_id("steps-expired-release");
    let reborn = fresh_id("steps-expired-release");
    for op in [&expired, &reborn] {
        let epoch = acquire(store, op, FP, LEASE).await;
        assert_eq!(put_step(store, op, epoch, "a", "5").await, Fence::Held);
        assert_eq!(store.release(op, epoch, TINY).await.unwrap(), Fence::Held);
    }
    tokio::time::sleep(PAST_TINY).await;
    let epoch = acquire(store, &reborn, OTHER_FP, LEASE).await;
    assert!(
        step_list(store, &reborn).await.is_empty(),
        "an expired release claimed afresh lists its steps"
    );
    assert_eq!(put_step(store, &reborn, epoch, "b", "6").await, Fence::Held);
    assert_eq!(
        step_list(store, &reborn).await,
        [step("b", epoch, "6")],
        "the first step after an expired release kept the released steps"
    );
    assert!(
        store.purge_expired().await.unwrap() >= 1,
        "purge removes an expired release"
    );
    if let Ok(found) = store.get(&expired).await {
        assert_eq!(found, None, "an expired release is purged");
    }
    the_next_life_starts_clean(store, &expired, "a purge of an expired release").await;
}

/// Steps of one operation recorded at once (a body that joins them) all hold and are
/// all listed: their writes queue on the record rather than deadlock or overwrite one
/// another.
pub async fn steps_of_one_operation_record_at_once(store: &dyn Store) {
    for _ in 0..10 {
        let id = fresh_id("steps-at-once");
        let epoch = acquire(store, &id, FP, LEASE).await;
        let value = outcome("1");
        let write = |label| store.record_step(&id, epoch, label, &value);
        let fences = tokio::join!(write("a"), write("b"), write("c"), write("d"));
        for fence in [fences.0, fences.1, fences.2, fences.3] {
            assert_eq!(
                fence.expect("a step recorded beside others"),
                Fence::Held,
                "{id}: a step recorded beside others was fenced"
            );
        }
        let mut labels: Vec<String> = step_list(store, &id)
            .await
            .into_iter()
            .map(|(label, _, _)| label)
            .collect();
        labels.sort();
        assert_eq!(
            labels,
            ["a", "b", "c", "d"],
            "{id}: steps recorded at once are listed once each"
        );
    }
}

/// ABSENT → IN_PROGRESS → COMPLETED; duplicates see in-flight, then the outcome; a
/// record retried after its reply was lost holds, another outcome does not.
pub async fn fresh_claim_in_flight_then_replay(store: &dyn Store) {
    let id = fresh_id("replay");
    let epoch = acquire(store, &id, FP, LEASE).await;
    match claim(store, &id, FP, LEASE).await {
        // A store with a millisecond clock holds a lease up to 2 ms past its length.
        Claim::InFlight { retry_after } => assert!(
            retry_after <= LEASE + Duration::from_millis(2),
            "{retry_after:?}"
        ),
        other => panic!("a live claim must be in flight, got {other:?}"),
    }
    if let Ok(Some(detail)) = store.get(&id).await {
        let left = detail.lease_remaining;
        assert!(
            left.is_some_and(|l| l > Duration::ZERO && l <= LEASE + Duration::from_millis(2)),
            "a fresh claim of a {LEASE:?} lease shows {left:?} of it left"
        );
    }
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    let done = StoredOutcome {
        is_err: true,
        version: 3,
        body: b"{\"declined\":true}".as_slice().into(),
    };
    assert_eq!(
        store.record(&id, epoch, &done, DAY).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(done.clone())
    );
    if let Ok(detail) = store.get(&id).await {
        let detail = detail.expect("get finds the record");
        assert_eq!(detail.info.state, State::Completed);
        assert_eq!(detail.outcome.as_ref(), Some(&done));
        assert!(detail.expires_in.is_some_and(|d| d <= DAY && d > DAY / 2));
    }
    if let Some(peeked) = store.peek_completed(&id, &FP).await.unwrap() {
        assert_eq!(peeked, Ok(done.clone()), "peek must return the outcome");
    }
    assert_eq!(
        store.record(&id, epoch, &done, DAY).await.unwrap(),
        Fence::Held,
        "the same record retried must hold"
    );
    assert_eq!(
        store.record(&id, epoch, &outcome("2"), DAY).await.unwrap(),
        Fence::Lost,
        "another outcome over a completed record must be fenced"
    );
}

/// Another fingerprint is a mismatch whatever the state, and never takes over.
pub async fn mismatch_in_every_state(store: &dyn Store) {
    let id = fresh_id("mismatch");
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert_eq!(claim(store, &id, OTHER_FP, LEASE).await, Claim::Mismatch);
    store.record(&id, epoch, &outcome("1"), DAY).await.unwrap();
    assert_eq!(claim(store, &id, OTHER_FP, LEASE).await, Claim::Mismatch);
    if let Some(peeked) = store.peek_completed(&id, &OTHER_FP).await.unwrap() {
        assert_eq!(peeked, Err(Mismatched));
    }

    let unknown = fresh_id("mismatch");
    let epoch = acquire(store, &unknown, FP, LEASE).await;
    assert_eq!(
        store.mark_unknown(&unknown, epoch).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &unknown, OTHER_FP, LEASE).await,
        Claim::Mismatch
    );
    assert_eq!(
        claim(store, &unknown, FP, LEASE).await,
        Claim::Unknown { epoch, now: false }
    );

    let lapsed = fresh_id("mismatch");
    acquire(store, &lapsed, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(
        claim(store, &lapsed, OTHER_FP, LEASE).await,
        Claim::Mismatch
    );
}

/// A lapsed lease is taken over at a higher epoch; every write of the old epoch is
/// fenced, the new one's hold.
pub async fn lapsed_lease_is_taken_over_and_fenced(store: &dyn Store) {
    let id = fresh_id("takeover");
    let old = acquire(store, &id, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    let new = match claim(store, &id, FP, LEASE).await {
        Claim::Acquired {
            epoch,
            takeover: true,
            ..
        } => epoch,
        other => panic!("a lapsed lease must be taken over, got {other:?}"),
    };
    assert!(new > old, "takeover epoch {new} must be above {old}");
    assert!(matches!(
        claim(store, &id, FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(store.renew(&id, old, LEASE).await.unwrap(), Fence::Lost);
    assert_eq!(store.release(&id, old, DAY).await.unwrap(), Fence::Lost);
    assert_eq!(store.mark_unknown(&id, old).await.unwrap(), Fence::Lost);
    assert_eq!(
        store.record(&id, old, &outcome("late"), DAY).await.unwrap(),
        Fence::Lost,
        "a late finisher must be fenced"
    );
    assert_eq!(store.renew(&id, new, LEASE).await.unwrap(), Fence::Held);
    assert_eq!(
        store.record(&id, new, &outcome("ok"), DAY).await.unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(outcome("ok"))
    );
}

/// A lease holds for its whole length from the moment its claim or renewal was sent,
/// which is what a caller counts on: a claim answered before then finds it in flight. A
/// store whose clock reads whole milliseconds rounds a lease's end up; rounded down, a
/// claim sent in the lease's last millisecond could take it over early.
///
/// Probes are claims sent ever closer to the lease's end; one answered after the end
/// proves nothing (the lease may have lapsed meanwhile) and the next is sent earlier.
pub async fn a_lease_holds_its_full_length(store: &dyn Store) {
    use tokio::time::Instant;
    const SHORT: Duration = Duration::from_millis(40);
    const PROBES: u32 = 16;
    // How long before the lease's end a probe is sent.
    let mut early = Duration::from_micros(500);
    let mut conclusive = 0;
    for attempt in 0..400 {
        if conclusive == PROBES {
            break;
        }
        let id = fresh_id("full-lease");
        let after_renewal = attempt % 2 == 1;
        let mut sent = Instant::now();
        let epoch = acquire(store, &id, FP, SHORT).await;
        if after_renewal {
            sent = Instant::now();
            let fence = store.renew(&id, epoch, SHORT).await.expect("renew");
            assert_eq!(fence, Fence::Held, "{id}: a live claim's renewal");
        }
        let end = sent + SHORT;
        let probe_at = end - early;
        if Instant::now() >= probe_at {
            early = (early * 2).min(SHORT / 2);
            continue;
        }
        // The timer to within a couple of milliseconds, then a spin to the instant.
        tokio::time::sleep_until(probe_at - Duration::from_millis(2)).await;
        while Instant::now() < probe_at {
            std::hint::spin_loop();
        }
        let probe = claim(store, &id, FP, SHORT).await;
        let answered = Instant::now();
        if answered >= end {
            early = (early * 2).min(SHORT / 2);
            continue;
        }
        conclusive += 1;
        assert!(
            matches!(probe, Claim::InFlight { .. }),
            "{id}: a claim answered {:?} before the end of a {SHORT:?} lease (sent \
             {:?} after its {}) took it over: {probe:?}",
            end - answered,
            probe_at - sent,
            if after_renewal { "renewal" } else { "claim" },
        );
        early = (early * 3 / 4).max(Duration::from_micros(50));
    }
    assert_eq!(
        conclusive, PROBES,
        "too few claims were answered before the lease's end to check it"
    );
}

/// Under `Takeover::Unknown` a lapsed lease goes to UNKNOWN at the same epoch; only
/// `resolve` moves it on.
pub async fn lapsed_lease_goes_unknown(store: &dyn Store) {
    let id = fresh_id("to-unknown");
    let epoch = acquire(store, &id, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    let to_unknown = |store| claim_with(store, &id, FP, LEASE, Takeover::Unknown);
    assert_eq!(to_unknown(store).await, Claim::Unknown { epoch, now: true });
    assert_eq!(
        to_unknown(store).await,
        Claim::Unknown { epoch, now: false }
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Unknown { epoch, now: false }
    );
    assert_eq!(
        store
            .record(&id, epoch, &outcome("late"), DAY)
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        store.resolve(&id, epoch + 1, None).await.unwrap(),
        Fence::Lost
    );
    assert_eq!(store.resolve(&id, epoch, None).await.unwrap(), Fence::Held);
    let again = acquire(store, &id, FP, LEASE).await;
    assert_ne!(again, epoch);
}

/// `resolve` with an outcome completes an UNKNOWN record; without one it removes it.
pub async fn resolve_records_or_removes(store: &dyn Store) {
    let id = fresh_id("resolve");
    let epoch = acquire(store, &id, FP, LEASE).await;
    store.mark_unknown(&id, epoch).await.unwrap();
    let settled = outcome("\"settled\"");
    assert_eq!(
        store
            .resolve(&id, epoch, Some((&settled, DAY)))
            .await
            .unwrap(),
        Fence::Held
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(settled)
    );
    assert_eq!(
        store.resolve(&id, epoch, None).await.unwrap(),
        Fence::Lost,
        "a completed record cannot be resolved"
    );
}

/// `forget` deletes a COMPLETED or UNKNOWN record and a lapsed claim, fenced by the
/// epoch; never a claim whose lease holds. A forgotten operation is absent: another
/// payload claims it afresh, at an epoch never used before.
pub async fn forget_drops_settled_records_only(store: &dyn Store) {
    // COMPLETED, say by a mistaken resolve: forgotten, the next call runs.
    let id = fresh_id("forget");
    let epoch = acquire(store, &id, FP, LEASE).await;
    store.mark_unknown(&id, epoch).await.unwrap();
    let wrong = outcome("\"wrong\"");
    store
        .resolve(&id, epoch, Some((&wrong, DAY)))
        .await
        .unwrap();
    assert_eq!(
        store.forget(&id, epoch + 1).await.unwrap(),
        Fence::Lost,
        "forget at another epoch"
    );
    assert_eq!(
        claim(store, &id, FP, LEASE).await,
        Claim::Completed(wrong.clone()),
        "a fenced forget deleted nothing"
    );
    assert_eq!(store.forget(&id, epoch).await.unwrap(), Fence::Held);
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    if let Ok(detail) = store.get(&id).await {
        assert_eq!(detail, None, "a forgotten record is gone");
    }
    assert_eq!(
        store.forget(&id, epoch).await.unwrap(),
        Fence::Lost,
        "forget twice"
    );
    let next = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(next > epoch, "epoch {next} after a forget of {epoch}");
    assert_eq!(
        store
            .record(&id, epoch, &outcome("late"), DAY)
            .await
            .unwrap(),
        Fence::Lost
    );

    // IN_PROGRESS under a live lease: refused, the claim stands.
    assert_eq!(store.forget(&id, next).await.unwrap(), Fence::Lost);
    assert!(matches!(
        claim(store, &id, OTHER_FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(
        store.record(&id, next, &outcome("ok"), DAY).await.unwrap(),
        Fence::Held
    );

    // UNKNOWN, and a claim whose lease lapsed.
    let unknown = fresh_id("forget");
    let u = acquire(store, &unknown, FP, LEASE).await;
    store.mark_unknown(&unknown, u).await.unwrap();
    assert_eq!(store.forget(&unknown, u).await.unwrap(), Fence::Held);
    acquire(store, &unknown, OTHER_FP, LEASE).await;
    let lapsed = fresh_id("forget");
    let l = acquire(store, &lapsed, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(store.forget(&lapsed, l).await.unwrap(), Fence::Held);
    assert!(matches!(
        claim(store, &lapsed, OTHER_FP, LEASE).await,
        Claim::Acquired {
            takeover: false,
            ..
        }
    ));
}

/// A released claim is absent: another payload then claims afresh.
pub async fn release_lets_the_next_call_run(store: &dyn Store) {
    let id = fresh_id("release");
    let epoch = acquire(store, &id, FP, LEASE).await;
    assert_eq!(
        store.release(&id, epoch + 1, DAY).await.unwrap(),
        Fence::Lost
    );
    assert_eq!(store.release(&id, epoch, DAY).await.unwrap(), Fence::Held);
    assert_eq!(store.release(&id, epoch, DAY).await.unwrap(), Fence::Lost);
    acquire(store, &id, OTHER_FP, LEASE).await;
    assert_eq!(
        store.release(&id, u64::MAX, DAY).await.unwrap(),
        Fence::Lost
    );
}

/// An expired outcome is absent: a new payload binds, and the old epoch is fenced.
pub async fn expired_is_claimed_afresh(store: &dyn Store) {
    let id = fresh_id("expired");
    let old = acquire(store, &id, FP, LEASE).await;
    store
        .record(&id, old, &outcome("old"), Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(PAST_TINY).await;
    assert_eq!(store.peek_completed(&id, &FP).await.unwrap(), None);
    let new = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(new > old);
    assert_eq!(claim(store, &id, FP, LEASE).await, Claim::Mismatch);
    assert!(
        matches!(
            claim(store, &id, OTHER_FP, LEASE).await,
            Claim::InFlight { .. }
        ),
        "the new life's claim holds its lease"
    );
    assert_eq!(
        store
            .record(&id, old, &outcome("stale"), DAY)
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        store.record(&id, new, &outcome("new"), DAY).await.unwrap(),
        Fence::Held
    );
}

/// A fence identifies one claim for all time: after a release, an operator's retry or
/// a purge removed the record, the next claim's epoch differs from every earlier one,
/// so a late finisher of an earlier claim stays fenced.
pub async fn epochs_never_repeat(store: &dyn Store) {
    let id = fresh_id("epochs");
    let mut seen = Vec::new();
    // A stalled first claim, taken over.
    let first = acquire(store, &id, FP, TINY).await;
    seen.push(first);
    tokio::time::sleep(PAST_TINY).await;
    let Claim::Acquired { epoch: second, .. } = claim(store, &id, FP, LEASE).await else {
        panic!("takeover expected");
    };
    seen.push(second);
    // The taker releases: the record is gone.
    assert_eq!(store.release(&id, second, DAY).await.unwrap(), Fence::Held);
    let third = acquire(store, &id, OTHER_FP, LEASE).await;
    assert!(
        !seen.contains(&third),
        "epoch {third} reused after a release ({seen:?})"
    );
    seen.push(third);
    // The stalled first owner wakes up: every write of its epoch is fenced.
    assert_eq!(store.renew(&id, first, LEASE).await.unwrap(), Fence::Lost);
    assert_eq!(
        store
            .record(&id, first, &outcome("late"), DAY)
            .await
            .unwrap(),
        Fence::Lost,
        "a late finisher passed the fence of a newer claim"
    );
    // An operator's retry removes the record too.
    store.mark_unknown(&id, third).await.unwrap();
    assert_eq!(store.resolve(&id, third, None).await.unwrap(), Fence::Held);
    let fourth = acquire(store, &id, FP, LEASE).await;
    assert!(
        !seen.contains(&fourth),
        "epoch {fourth} reused after a resolve ({seen:?})"
    );
    seen.push(fourth);
    for old in &seen[..3] {
        assert_eq!(store.renew(&id, *old, LEASE).await.unwrap(), Fence::Lost);
    }
    // And a purge of an expired outcome.
    store
        .record(&id, fourth, &outcome("done"), Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(PAST_TINY).await;
    store.purge_expired().await.unwrap();
    let fifth = acquire(store, &id, FP, LEASE).await;
    assert!(
        !seen.contains(&fifth),
        "epoch {fifth} reused after a purge ({seen:?})"
    );
    for old in &seen {
        assert_eq!(
            store
                .record(&id, *old, &outcome("late"), DAY)
                .await
                .unwrap(),
            Fence::Lost
        );
    }
}

/// Purge removes COMPLETED records past retention, never claims in progress or UNKNOWN
/// records (released ones: `a_released_operation_expires`).
pub async fn purge_removes_only_expired_completed(store: &dyn Store) {
    let live = fresh_id("purge");
    let expired = fresh_id("purge");
    let running = fresh_id("purge");
    let unknown = fresh_id("purge");
    let lapsed = fresh_id("purge");
    let e = acquire(store, &live, FP, LEASE).await;
    store.record(&live, e, &outcome("1"), DAY).await.unwrap();
    let e = acquire(store, &expired, FP, LEASE).await;
    store
        .record(&expired, e, &outcome("1"), Duration::from_millis(1))
        .await
        .unwrap();
    acquire(store, &running, FP, LEASE).await;
    let u = acquire(store, &unknown, FP, LEASE).await;
    store.mark_unknown(&unknown, u).await.unwrap();
    acquire(store, &lapsed, FP, TINY).await;
    tokio::time::sleep(PAST_TINY).await;

    assert!(store.purge_expired().await.unwrap() >= 1);
    assert_eq!(store.purge_expired().await.unwrap(), 0, "purge twice");
    assert_eq!(
        claim(store, &live, FP, LEASE).await,
        Claim::Completed(outcome("1"))
    );
    assert!(matches!(
        claim(store, &running, FP, LEASE).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(
        claim(store, &unknown, FP, LEASE).await,
        Claim::Unknown {
            epoch: u,
            now: false
        }
    );
    // The lapsed claim survived the purge: it is taken over, not claimed afresh.
    assert!(matches!(
        claim(store, &lapsed, FP, LEASE).await,
        Claim::Acquired { takeover: true, .. }
    ));
    // The expired one is gone or claimable afresh.
    acquire(store, &expired, OTHER_FP, LEASE).await;
}

/// `stats` counts by state; `list` filters by state and name, oldest first.
pub async fn stats_and_list(store: &dyn Store) {
    let before = store.stats().await.unwrap();
    let a = fresh_id("list-a");
    let b = fresh_id("list-b");
    acquire(store, &a, FP, LEASE).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let eb = acquire(store, &b, FP, LEASE).await;
    store.mark_unknown(&b, eb).await.unwrap();
    let after = store.stats().await.unwrap();
    assert!(after.in_progress > before.in_progress);
    assert!(after.unknown > before.unknown);
    assert!(after.oldest_in_progress.is_some() && after.oldest_unknown.is_some());

    let all = |name: &str, state| ListFilter {
        name: Some(name.into()),
        state,
        limit: Some(1000),
        ..Default::default()
    };
    if let Ok(detail) = store.get(&b).await {
        let detail = detail.expect("get finds the record");
        assert_eq!((detail.info.state, detail.info.epoch), (State::Unknown, eb));
        assert_eq!(detail.outcome, None);
        assert_eq!(store.get(&fresh_id("absent")).await.unwrap(), None);
    }
    let rows = store
        .list(&all("list-b", Some(State::Unknown)))
        .await
        .unwrap();
    let row = rows
        .iter()
        .find(|r| r.id == b)
        .expect("UNKNOWN record listed");
    assert_eq!((row.state, row.epoch), (State::Unknown, eb));
    let rows = store.list(&all("list-a", None)).await.unwrap();
    assert!(
        rows.iter()
            .any(|r| r.id == a && r.state == State::InProgress)
    );
    assert!(
        rows.iter().all(|r| r.id.name == "list-a"),
        "the name filter leaked"
    );
    let stuck = store.list(&ListFilter::stuck(DAY)).await.unwrap();
    assert!(
        !stuck.iter().any(|r| r.id == a),
        "a new claim is not stuck for a day"
    );
    let scoped = |scope: &str| ListFilter {
        name: Some("list-a".into()),
        scope: Some(scope.into()),
        limit: Some(1000),
        ..Default::default()
    };
    let rows = store.list(&scoped(&a.scope)).await.unwrap();
    assert!(rows.iter().any(|r| r.id == a), "listed in its own scope");
    let rows = store.list(&scoped("another scope")).await.unwrap();
    assert!(rows.is_empty(), "the scope filter leaked: {rows:?}");
    let one = ListFilter {
        limit: Some(1),
        ..Default::default()
    };
    assert_eq!(store.list(&one).await.unwrap().len(), 1);

    // `a` was claimed at least 5 ms before `b`.
    let position =
        |rows: &[crate::store::RecordInfo], id: &OperationId| rows.iter().position(|r| &r.id == id);
    let mine = |rows: Vec<crate::store::RecordInfo>| -> Vec<crate::store::RecordInfo> {
        rows.into_iter()
            .filter(|r| r.id == a || r.id == b)
            .collect()
    };
    let newest = mine(
        store
            .list(&ListFilter::default().newest_first().limit(100_000))
            .await
            .unwrap(),
    );
    assert!(
        position(&newest, &b) < position(&newest, &a) && position(&newest, &a).is_some(),
        "newest first lists the later claim first: {newest:?}"
    );
    let oldest = mine(
        store
            .list(&ListFilter::default().limit(100_000))
            .await
            .unwrap(),
    );
    assert!(
        position(&oldest, &a) < position(&oldest, &b) && position(&oldest, &b).is_some(),
        "oldest first by default: {oldest:?}"
    );
    let recent = store
        .list(&ListFilter::recent(DAY).limit(100_000))
        .await
        .unwrap();
    assert!(
        position(&recent, &a).is_some() && position(&recent, &b).is_some(),
        "claims made now are newer than a day"
    );
    let just_now = store
        .list(&ListFilter::recent(Duration::from_millis(1)).limit(100_000))
        .await
        .unwrap();
    assert!(
        position(&just_now, &a).is_none(),
        "a claim 5 ms old is not newer than 1 ms: {just_now:?}"
    );
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub mod tx {
    //! Transactional mode's checks: [`Operation::begin_tx`](crate::Operation::begin_tx) and
    //! [`TxGuard::finish`](crate::TxGuard::finish) on one database, written once for
    //! SQLite, PostgreSQL and MySQL/MariaDB.
    //!
    //! Each check takes a [`TxTarget`]: a pool, an [`Idem`] on the same database, a business
    //! table whose rows the bodies write, and how to begin and abandon transactions there.
    //! Each check works on order ids and operation keys of its own (unique per call), so
    //! the checks may share one target and run in any order. Each panics with a message
    //! naming the behaviour that broke. A database's tests call [`run_all`], or each
    //! check as a test of its own:
    //!
    //! ```no_run
    //! # #[cfg(feature = "sqlite")]
    //! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    //! use idem_runtime::Idem;
    //! use idem_runtime::store::conformance::tx::{self, TxTarget};
    //!
    //! let pool = sqlx::SqlitePool::connect("sqlite:///tmp/app.db?mode=rwc").await?;
    //! sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
    //!     .execute(&pool)
    //!     .await?;
    //! let idem = Idem::from_pool(pool.clone()).await?;
    //! let target = TxTarget::new(pool, idem, "orders")
    //!     .begin_with(|pool| async move { pool.begin_with("BEGIN IMMEDIATE").await });
    //! tx::run_all(&target).await;
    //! # Ok(()) }
    //! ```

    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::time::Duration;

    use serde::{Deserialize, Serialize};
    use sqlx::{Pool, Transaction};

    use crate::{Disposition, Idem, IdemError, TxConnection, TxStep};

    const DAY: Duration = Duration::from_secs(86_400);

    type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
    type Begin<DB> = Arc<
        dyn Fn(Pool<DB>) -> BoxFuture<'static, Result<Transaction<'static, DB>, sqlx::Error>>
            + Send
            + Sync,
    >;
    type Abandon<DB> =
        Arc<dyn Fn(Transaction<'static, DB>) -> BoxFuture<'static, ()> + Send + Sync>;

    mod sealed {
        pub trait Sealed {}
    }

    /// A database transactional mode runs on: `sqlx::Sqlite`, `sqlx::Postgres` or
    /// `sqlx::MySql`, each under its feature. Sealed: the checks' own statements are
    /// written for these.
    pub trait TxDatabase: sqlx::Database + sealed::Sealed {
        /// `Transaction<'static, Self>`, named through the trait so that generic code
        /// needs no `Transaction<'static, DB>: TxConnection` bound, which would hide
        /// that a transaction of any lifetime is `Send` and keep the checks' futures
        /// from being spawned.
        #[doc(hidden)]
        type Tx: TxConnection;
        /// `tx` as [`Tx`](Self::Tx).
        #[doc(hidden)]
        fn tx<'a>(tx: &'a mut Transaction<'static, Self>) -> &'a mut Self::Tx;
        /// Runs `sql`, which binds nothing, on `conn`, over the text protocol (MySQL does
        /// not prepare savepoint statements).
        #[doc(hidden)]
        fn execute(
            conn: &mut Self::Connection,
            sql: String,
        ) -> BoxFuture<'_, Result<(), sqlx::Error>>;
        /// The `(id, qty)` rows that `sql` selects through `pool`.
        #[doc(hidden)]
        fn rows(
            pool: &Pool<Self>,
            sql: String,
        ) -> BoxFuture<'static, Result<Vec<(String, i64)>, sqlx::Error>>;
    }

    // Concrete per database, so the checks need no sqlx bounds of their own; boxed, so
    // their futures stay `Send` whatever the connection's lifetime.
    macro_rules! tx_database {
        ($feature:literal, $db:ty) => {
            #[cfg(feature = $feature)]
            impl sealed::Sealed for $db {}
            #[cfg(feature = $feature)]
            impl TxDatabase for $db {
                type Tx = Transaction<'static, $db>;
                fn tx<'a>(tx: &'a mut Transaction<'static, Self>) -> &'a mut Self::Tx {
                    tx
                }
                fn execute(
                    conn: &mut Self::Connection,
                    sql: String,
                ) -> BoxFuture<'_, Result<(), sqlx::Error>> {
                    Box::pin(async move {
                        use sqlx::Executor as _;
                        conn.execute(sqlx::raw_sql(&sql)).await.map(drop)
                    })
                }
                fn rows(
                    pool: &Pool<Self>,
                    sql: String,
                ) -> BoxFuture<'static, Result<Vec<(String, i64)>, sqlx::Error>> {
                    let pool = pool.clone();
                    Box::pin(async move { sqlx::query_as(&sql).fetch_all(&pool).await })
                }
            }
        };
    }
    tx_database!("sqlite", sqlx::Sqlite);
    tx_database!("postgres", sqlx::Postgres);
    tx_database!("mysql", sqlx::MySql);

    /// One database under test: what the checks run on, and what differs between
    /// databases.
    pub struct TxTarget<DB: sqlx::Database> {
        pool: Pool<DB>,
        idem: Idem,
        table: String,
        begin: Begin<DB>,
        begin_snapshot: Begin<DB>,
        /// `None`: as `begin`.
        begin_cancellable: Option<Begin<DB>>,
        abandon: Abandon<DB>,
    }

    impl<DB: sqlx::Database> Clone for TxTarget<DB> {
        fn clone(&self) -> Self {
            TxTarget {
                pool: self.pool.clone(),
                idem: self.idem.clone(),
                table: self.table.clone(),
                begin: self.begin.clone(),
                begin_snapshot: self.begin_snapshot.clone(),
                begin_cancellable: self.begin_cancellable.clone(),
                abandon: self.abandon.clone(),
            }
        }
    }

    impl<DB: TxDatabase> TxTarget<DB> {
        /// The checks on `pool`, claiming through `idem` (a store on the same database,
        /// as [`Idem::from_pool`] opens), with bodies writing to `table`: an existing
        /// table, qualified as the pool's connections need, with the columns `id`
        /// (text of up to 64 characters, the primary key) and `qty` (a 64-bit integer).
        ///
        /// Transactions begin with `pool.begin()`, and a cancelled call's transaction is
        /// rolled back, until the methods below say otherwise.
        pub fn new(pool: Pool<DB>, idem: Idem, table: impl Into<String>) -> Self {
            let plain: Begin<DB> =
                Arc::new(|pool: Pool<DB>| Box::pin(async move { pool.begin().await }));
            TxTarget {
                pool,
                idem,
                table: table.into(),
                begin: plain.clone(),
                begin_snapshot: plain,
                begin_cancellable: None,
                abandon: Arc::new(|tx| {
                    Box::pin(async move {
                        let _ = tx.rollback().await;
                    })
                }),
            }
        }

        /// How a transaction begins, where a duplicate must wait for another's claim to
        /// commit or roll back: on SQLite `BEGIN IMMEDIATE`, which takes the write lock
        /// up front (SQLite has no row locks). Also how a cancellable one begins, unless
        /// [`cancellable_with`](Self::cancellable_with) says.
        pub fn begin_with<F, Fut>(mut self, begin: F) -> Self
        where
            F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
        {
            self.begin = boxed(begin);
            self
        }

        /// How a transaction begins that reads from a snapshot taken at its first read
        /// (REPEATABLE READ, or a deferred SQLite `BEGIN`), for the check that a
        /// duplicate whose snapshot predates the first's commit is never run again.
        /// Default: `pool.begin()`.
        pub fn begin_snapshot_with<F, Fut>(mut self, begin: F) -> Self
        where
            F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
        {
            self.begin_snapshot = boxed(begin);
            self
        }

        /// How a transaction whose call may be cancelled mid-statement begins, and how
        /// it is abandoned after a cancellation. On MySQL the connection is closed
        /// rather than sent a `ROLLBACK`: sqlx's MySQL driver cannot go on with a
        /// connection whose statement is unanswered, and the server discards the open
        /// transaction of a session that closes.
        pub fn cancellable_with<F, Fut, A, AFut>(mut self, begin: F, abandon: A) -> Self
        where
            F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
            A: Fn(Transaction<'static, DB>) -> AFut + Send + Sync + 'static,
            AFut: Future<Output = ()> + Send + 'static,
        {
            self.begin_cancellable = Some(boxed(begin));
            self.abandon = Arc::new(move |tx| Box::pin(abandon(tx)));
            self
        }

        /// The pool the transactions begin on.
        pub fn pool(&self) -> &Pool<DB> {
            &self.pool
        }

        /// The `Idem` the operations claim through.
        pub fn idem(&self) -> &Idem {
            &self.idem
        }

        /// The business table the bodies write to.
        pub fn table(&self) -> &str {
            &self.table
        }

        async fn begin(&self) -> Transaction<'static, DB> {
            (self.begin)(self.pool.clone())
                .await
                .expect("begin a transaction")
        }

        async fn begin_snapshot(&self) -> Transaction<'static, DB> {
            (self.begin_snapshot)(self.pool.clone())
                .await
                .expect("begin a snapshot transaction")
        }

        async fn begin_cancellable(&self) -> Transaction<'static, DB> {
            let begin = self.begin_cancellable.as_ref().unwrap_or(&self.begin);
            begin(self.pool.clone())
                .await
                .expect("begin a cancellable transaction")
        }

        /// Inserts the business row `(id, qty)` in `tx`; `id` is one of the checks' own,
        /// so it needs no quoting.
        async fn insert(
            &self,
            tx: &mut Transaction<'static, DB>,
            id: &str,
            qty: i64,
        ) -> Result<(), sqlx::Error> {
            let sql = format!(
                "INSERT INTO {} (id, qty) VALUES ('{id}', {qty})",
                self.table
            );
            DB::execute(&mut **tx, sql).await
        }

        /// The committed business rows whose id is `id` or starts with `id#`.
        async fn rows(&self, id: &str) -> Vec<(String, i64)> {
            let sql = format!(
                "SELECT id, qty FROM {} WHERE id = '{id}' OR id LIKE '{id}#%'",
                self.table
            );
            DB::rows(&self.pool, sql)
                .await
                .expect("read the business table")
        }
    }

    fn boxed<DB, F, Fut>(begin: F) -> Begin<DB>
    where
        DB: sqlx::Database,
        F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
    {
        Arc::new(move |pool| Box::pin(begin(pool)))
    }

    /// What the checks' bodies fail with: released by default, recorded where a check
    /// records errors. idem's own errors are answered, never recorded.
    #[derive(Debug, Serialize, Deserialize)]
    enum Failure {
        Declined(String),
        Timeout,
        #[serde(skip)]
        Idem(IdemError),
    }

    impl From<IdemError> for Failure {
        fn from(e: IdemError) -> Self {
            Failure::Idem(e)
        }
    }

    /// An id no other check (and no earlier run on a durable database) uses: short, as
    /// the business table's id holds 64 characters, and free of `_` and `%`, which
    /// `LIKE` would read as wildcards.
    fn fresh(check: &str) -> String {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{check}-{:x}-{nanos:x}-{n}", std::process::id())
    }

    /// Places `order` in `tx`: one business row, claimed and recorded in the same
    /// transaction, answering `qty * 100`. `fail` makes the body write, then return a
    /// released error.
    async fn place<DB>(
        t: &TxTarget<DB>,
        tx: &mut Transaction<'static, DB>,
        order: &str,
        qty: i64,
        fail: bool,
    ) -> Result<i64, Failure>
    where
        DB: TxDatabase,
    {
        let op = t
            .idem
            .operation("place_order", order)
            .fingerprint(&qty)
            .retain(DAY);
        let guard = match op.begin_tx(DB::tx(tx)).await? {
            TxStep::Replay(out) => return out,
            TxStep::Run(g) => g,
        };
        let out = async {
            t.insert(tx, order, qty)
                .await
                .map_err(|e| Failure::Declined(e.to_string()))?;
            if fail {
                Err(Failure::Timeout)
            } else {
                Ok(qty * 100)
            }
        }
        .await;
        guard.finish(DB::tx(tx), out).await
    }

    /// Places `order` in a transaction of its own, committed if the body answered `Ok`
    /// and rolled back otherwise: the answer.
    async fn place_committed<DB>(t: &TxTarget<DB>, order: &str, qty: i64) -> Result<i64, Failure>
    where
        DB: TxDatabase,
    {
        let mut tx = t.begin().await;
        let out = place(t, &mut tx, order, qty, false).await;
        if out.is_ok() {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        out
    }

    /// Claims `order` (payload `qty`) in `tx` for a body the check runs by hand.
    async fn claim<DB>(
        t: &TxTarget<DB>,
        tx: &mut Transaction<'static, DB>,
        order: &str,
        qty: i64,
    ) -> Result<
        TxStep<i64, Failure, crate::TxGuard<crate::ReleaseErrors, crate::NoUpgrade>>,
        IdemError,
    >
    where
        DB: TxDatabase,
    {
        let op = t
            .idem
            .operation("place_order", order)
            .fingerprint(&qty)
            .retain(DAY);
        op.begin_tx(DB::tx(tx)).await
    }

    /// Every check below, in turn.
    pub async fn run_all<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        committed_once_then_replayed(t).await;
        released_error_keeps_neither_writes_nor_claim(t).await;
        rolled_back_attempt_leaves_nothing(t).await;
        mismatch_in_transaction(t).await;
        a_claim_the_body_rolled_back_is_refused(t).await;
        a_record_is_fenced_by_its_claims_epoch(t).await;
        a_second_claim_in_the_same_transaction_is_in_flight(t).await;
        nested_operations_in_one_transaction_each_record(t).await;
        current_is_set_in_a_transactional_body(t).await;
        a_duplicate_waits_for_the_first_transaction(t).await;
        a_duplicate_from_an_older_snapshot_retries_or_replays(t).await;
        concurrent_duplicates_write_once(t).await;
        abandoned_claim_is_taken_over_after_its_lease(t).await;
        recorded_error_after_the_body_sql_failed(t).await;
        expired_outcome_is_claimed_afresh(t).await;
        unknown_is_answered_in_a_transaction(t).await;
        model_random_schedules(t).await;
    }

    /// A committed call writes once; the calls after it replay its answer.
    pub async fn committed_once_then_replayed<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("once");
        for _ in 0..3 {
            let mut tx = t.begin().await;
            let (got, info) = crate::observe(place(t, &mut tx, &order, 3, false)).await;
            assert_eq!(got.unwrap(), 300);
            assert!(info.recorded(), "{info:?}");
            tx.commit().await.unwrap();
        }
        assert_eq!(
            t.rows(&order).await,
            [(order, 3)],
            "the body's write committed once"
        );
    }

    /// A released `Err` rolls the body's writes and the claim back to idem's savepoint,
    /// even in a transaction the caller commits: the next call runs the body.
    pub async fn released_error_keeps_neither_writes_nor_claim<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("released");
        let mut tx = t.begin().await;
        let r = place(t, &mut tx, &order, 1, true).await;
        assert!(matches!(r, Err(Failure::Timeout)), "{r:?}");
        tx.commit().await.unwrap();
        assert_eq!(t.rows(&order).await, [], "the body's write was rolled back");
        assert_eq!(
            place_committed(t, &order, 1).await.unwrap(),
            100,
            "the claim was released"
        );
        assert_eq!(t.rows(&order).await.len(), 1);
    }

    /// Rollback is the release: a rolled back call leaves no record, and the next call,
    /// with another payload, runs.
    pub async fn rolled_back_attempt_leaves_nothing<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("rolled");
        let mut tx = t.begin().await;
        place(t, &mut tx, &order, 2, false).await.unwrap();
        tx.rollback().await.unwrap();
        let id = t.idem.operation("place_order", order.as_str()).id().clone();
        assert_eq!(
            t.idem.get(&id).await.unwrap(),
            None,
            "a rolled back claim left a record"
        );
        assert_eq!(
            place_committed(t, &order, 5).await.unwrap(),
            500,
            "the key is free again"
        );
        assert_eq!(t.rows(&order).await, [(order, 5)]);
    }

    /// Another payload on a committed key is a mismatch inside a transaction too.
    pub async fn mismatch_in_transaction<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("mismatch");
        place_committed(t, &order, 2).await.unwrap();
        let mut tx = t.begin().await;
        let r = place(t, &mut tx, &order, 9, false).await;
        assert!(
            matches!(r, Err(Failure::Idem(IdemError::Mismatch { .. }))),
            "{r:?}"
        );
        tx.rollback().await.unwrap();
    }

    /// A body that rolls back to its operation's savepoint (`idem_body_<n>`) takes the
    /// claim with it: its `Ok` is refused with a `Config` error naming that savepoint,
    /// never answered as if recorded (a commit and a retry would then run the body twice).
    pub async fn a_claim_the_body_rolled_back_is_refused<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("undone");
        let mut tx = t.begin().await;
        let TxStep::Run(guard) = claim(t, &mut tx, &order, 1).await.unwrap() else {
            panic!("a fresh key replayed");
        };
        let savepoint = guard.savepoint().to_owned();
        DB::execute(&mut *tx, format!("ROLLBACK TO SAVEPOINT {savepoint}"))
            .await
            .unwrap();
        t.insert(&mut tx, &order, 1).await.unwrap();
        let r = guard.finish(DB::tx(&mut tx), Ok::<_, Failure>(7)).await;
        let named = format!("savepoint `{savepoint}`");
        assert!(
            matches!(&r, Err(Failure::Idem(IdemError::Config { message }))
                if message.contains("vanished") && message.contains(&named)),
            "{r:?}"
        );
        tx.rollback().await.unwrap();
    }

    /// A record is fenced by its claim's epoch: once the key was claimed again at
    /// another epoch (here by the same transaction, taking over the first claim's lapsed
    /// lease), the first claim's guard records nothing and is refused, and the second's
    /// records.
    pub async fn a_record_is_fenced_by_its_claims_epoch<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("fenced");
        let lease = Duration::from_millis(50);
        let claim_leased = async |tx: &mut Transaction<'static, DB>| {
            let op = t
                .idem
                .operation("place_order", order.as_str())
                .fingerprint(&1i64)
                .lease(lease)
                .retain(DAY);
            match op.begin_tx::<_, i64, Failure>(DB::tx(tx)).await.unwrap() {
                TxStep::Run(guard) => guard,
                TxStep::Replay(_) => panic!("a claim in progress replayed"),
            }
        };
        let epoch = async |guard: &crate::TxGuard<_, _>| {
            guard.body(async { crate::current().epoch() }).await
        };
        let mut tx = t.begin().await;
        let first = claim_leased(&mut tx).await;
        tokio::time::sleep(lease * 3).await;
        let second = claim_leased(&mut tx).await;
        let (old, new) = (epoch(&first).await, epoch(&second).await);
        assert!(new > old, "the takeover's epoch {new} is not above {old}");
        let r = first.finish(DB::tx(&mut tx), Ok::<_, Failure>(1)).await;
        assert!(
            matches!(&r, Err(Failure::Idem(IdemError::Config { message })) if message.contains("vanished")),
            "the first claim's guard recorded over the second claim: {r:?}"
        );
        assert_eq!(
            second
                .finish(DB::tx(&mut tx), Ok::<_, Failure>(2))
                .await
                .unwrap(),
            2
        );
        tx.commit().await.unwrap();
        let mut tx = t.begin().await;
        assert!(matches!(
            claim(t, &mut tx, &order, 1).await,
            Ok(TxStep::Replay(Ok(2)))
        ));
        tx.rollback().await.unwrap();
    }

    /// A transaction claiming a key it already holds is told the operation is running,
    /// and the claim it holds still records; the rollback releases both.
    pub async fn a_second_claim_in_the_same_transaction_is_in_flight<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("twice");
        let mut tx = t.begin().await;
        let TxStep::Run(guard) = claim(t, &mut tx, &order, 1).await.unwrap() else {
            panic!("a fresh key replayed");
        };
        let again = claim(t, &mut tx, &order, 1).await;
        assert!(
            matches!(again, Err(IdemError::InFlight { .. })),
            "{:?}",
            again.err()
        );
        let r = guard.finish(DB::tx(&mut tx), Ok::<_, Failure>(1)).await;
        assert!(
            matches!(r, Ok(1)),
            "the claim held did not record after a refused second claim: {r:?}"
        );
        tx.rollback().await.unwrap();
        let mut tx = t.begin().await;
        assert!(
            matches!(claim(t, &mut tx, &order, 1).await, Ok(TxStep::Run(_))),
            "the key stayed claimed"
        );
        tx.rollback().await.unwrap();
    }

    /// Operations nested in one transaction (an idempotent function calling another
    /// with the same transaction) each record, and an inner released error rolls back
    /// only the inner body's writes; an operation also records after a second claim of
    /// its own key was refused in its transaction.
    pub async fn nested_operations_in_one_transaction_each_record<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let (outer, inner, failed) = (fresh("outer"), fresh("inner"), fresh("failed"));
        let mut tx = t.begin().await;
        let TxStep::Run(outer_guard) = claim(t, &mut tx, &outer, 1).await.unwrap() else {
            panic!("a fresh key replayed");
        };
        t.insert(&mut tx, &outer, 1).await.unwrap();
        assert_eq!(place(t, &mut tx, &inner, 2, false).await.unwrap(), 200);
        let r = place(t, &mut tx, &failed, 3, true).await;
        assert!(matches!(r, Err(Failure::Timeout)), "{r:?}");
        let again = claim(t, &mut tx, &outer, 1).await;
        assert!(
            matches!(again, Err(IdemError::InFlight { .. })),
            "{:?}",
            again.err()
        );
        let r = outer_guard
            .finish(DB::tx(&mut tx), Ok::<_, Failure>(100))
            .await;
        match r {
            Ok(v) => assert_eq!(v, 100),
            Err(e) => panic!("the outer operation did not record after inner ones: {e:?}"),
        }
        tx.commit().await.unwrap();
        assert_eq!(
            t.rows(&outer).await,
            [(outer.clone(), 1)],
            "the outer body's write"
        );
        assert_eq!(
            t.rows(&inner).await,
            [(inner.clone(), 2)],
            "the inner body's write"
        );
        assert_eq!(t.rows(&failed).await, [], "the failed inner body's write");
        let mut tx = t.begin().await;
        assert_eq!(place(t, &mut tx, &outer, 1, false).await.unwrap(), 100);
        assert_eq!(place(t, &mut tx, &inner, 2, false).await.unwrap(), 200);
        assert_eq!(
            place(t, &mut tx, &failed, 3, false).await.unwrap(),
            300,
            "the failed inner operation's claim was released"
        );
        tx.rollback().await.unwrap();
    }

    // The attribute in transactional mode, generic over the transaction type.
    #[crate::idempotent(crate = crate, store = idem, key = order, retain = "1d", tx = tx, name = "ship")]
    async fn ship<C: TxConnection>(
        idem: &Idem,
        tx: &mut C,
        order: &str,
    ) -> Result<(u64, String), Failure> {
        let _ = &tx;
        let cur = crate::current();
        Ok((cur.epoch(), cur.downstream_key("carrier")))
    }

    /// The running operation is visible in a transactional body, as in a leased one, at
    /// the epoch its claim holds; not after it.
    pub async fn current_is_set_in_a_transactional_body<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("current");
        let mut tx = t.begin().await;
        let (epoch, key) = ship(&t.idem, DB::tx(&mut tx), &order).await.unwrap();
        tx.commit().await.unwrap();
        assert!(crate::try_current().is_none());
        assert_eq!(key.len(), 64);
        let id = t.idem.operation("ship", order.as_str()).id().clone();
        let record = t
            .idem
            .get(&id)
            .await
            .unwrap()
            .expect("the call was recorded");
        assert_eq!(
            record.info.epoch, epoch,
            "current() saw another epoch than its claim's"
        );
    }

    /// A duplicate waits for the transaction holding the claim: once that commits it
    /// replays the outcome; once that rolls back it claims and runs, even with another
    /// payload.
    pub async fn a_duplicate_waits_for_the_first_transaction<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let duplicate = |order: String, qty| {
            let t = t.clone();
            tokio::spawn(async move {
                let mut tx = t.begin().await;
                let (out, info) = crate::observe(place(&t, &mut tx, &order, qty, false)).await;
                tx.commit().await.unwrap();
                (out.unwrap(), info.replayed())
            })
        };
        // Long enough that a duplicate not waiting would have answered.
        let wait = Duration::from_millis(200);

        let committed = fresh("waitc");
        let mut first = t.begin().await;
        let TxStep::Run(guard) = claim(t, &mut first, &committed, 1).await.unwrap() else {
            panic!("a fresh key replayed");
        };
        let second = duplicate(committed.clone(), 1);
        tokio::time::sleep(wait).await;
        assert!(
            !second.is_finished(),
            "a duplicate answered while the claim was uncommitted"
        );
        t.insert(&mut first, &committed, 1).await.unwrap();
        assert_eq!(
            guard
                .finish(DB::tx(&mut first), Ok::<_, Failure>(100))
                .await
                .unwrap(),
            100
        );
        first.commit().await.unwrap();
        assert_eq!(
            second.await.unwrap(),
            (100, true),
            "the duplicate replays the commit"
        );
        assert_eq!(t.rows(&committed).await.len(), 1);

        let rolled = fresh("waitr");
        let mut first = t.begin().await;
        let TxStep::Run(_guard) = claim(t, &mut first, &rolled, 1).await.unwrap() else {
            panic!("a fresh key replayed");
        };
        let second = duplicate(rolled.clone(), 2);
        tokio::time::sleep(wait).await;
        assert!(
            !second.is_finished(),
            "a duplicate answered while the claim was uncommitted"
        );
        first.rollback().await.unwrap();
        assert_eq!(
            second.await.unwrap(),
            (200, false),
            "the duplicate runs after a rollback"
        );
        assert_eq!(t.rows(&rolled).await, [(rolled, 2)]);
    }

    /// A duplicate whose snapshot was taken before the first transaction committed never
    /// runs the body again: it replays, or (PostgreSQL's REPEATABLE READ, a deferred
    /// SQLite transaction) fails with a retryable error, and the retried transaction
    /// replays.
    pub async fn a_duplicate_from_an_older_snapshot_retries_or_replays<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("snapshot");
        let mut first = t.begin().await;
        let TxStep::Run(guard) = claim(t, &mut first, &order, 1).await.unwrap() else {
            panic!("a fresh key replayed");
        };
        let (snapshot_taken, snapshot) = tokio::sync::oneshot::channel();
        let (committed, commit) = tokio::sync::oneshot::channel::<()>();
        let second = {
            let (t, order) = (t.clone(), order.clone());
            tokio::spawn(async move {
                let mut tx = t.begin_snapshot().await;
                // The first read takes the snapshot, before the first transaction commits.
                let read = format!("SELECT count(*) FROM {}", t.table);
                DB::execute(&mut *tx, read).await.unwrap();
                snapshot_taken.send(()).unwrap();
                commit.await.unwrap();
                let answer = match claim(&t, &mut tx, &order, 1).await {
                    Ok(TxStep::Replay(out)) => Ok(out.unwrap()),
                    Ok(TxStep::Run(_)) => panic!("a duplicate claimed a committed operation"),
                    Err(e) => Err(e),
                };
                let _ = tx.rollback().await;
                answer
            })
        };
        snapshot.await.unwrap();
        t.insert(&mut first, &order, 1).await.unwrap();
        assert_eq!(
            guard
                .finish(DB::tx(&mut first), Ok::<_, Failure>(100))
                .await
                .unwrap(),
            100
        );
        first.commit().await.unwrap();
        committed.send(()).unwrap();
        match second.await.unwrap() {
            Ok(v) => assert_eq!(v, 100),
            Err(e) => assert!(e.is_retryable(), "not retryable: {e}"),
        }
        assert_eq!(place_committed(t, &order, 1).await.unwrap(), 100);
        assert_eq!(t.rows(&order).await.len(), 1);
    }

    /// Callers released together on the same keys, each retrying its whole transaction
    /// on a retryable error (a serialization failure, a deadlock): each key is written
    /// once, and every caller answered its outcome.
    pub async fn concurrent_duplicates_write_once<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        const KEYS: usize = 50;
        const CALLERS: usize = 4;
        let base = fresh("conc");
        let barrier = Arc::new(tokio::sync::Barrier::new(KEYS * CALLERS));
        let tasks: Vec<_> = (0..KEYS * CALLERS)
            .map(|i| {
                let (t, barrier) = (t.clone(), barrier.clone());
                let order = format!("{base}#{}", i % KEYS);
                tokio::spawn(async move {
                    barrier.wait().await;
                    for _ in 0..50 {
                        let mut tx = t.begin().await;
                        match place(&t, &mut tx, &order, 1, false).await {
                            Ok(v) => {
                                if tx.commit().await.is_ok() {
                                    return v;
                                }
                            }
                            Err(Failure::Idem(e)) if e.is_retryable() => {}
                            Err(e) => panic!("{e:?}"),
                        }
                    }
                    panic!("no attempt committed");
                })
            })
            .collect();
        for task in tasks {
            assert_eq!(task.await.unwrap(), 100);
        }
        assert_eq!(t.rows(&base).await.len(), KEYS);
    }

    /// A claim whose body was cancelled (no finish) in a transaction the caller then
    /// committed holds while its lease runs (a duplicate is told it is already running)
    /// and lapses after it: a transactional or a leased call then takes it over, so the
    /// key is never blocked for good.
    pub async fn abandoned_claim_is_taken_over_after_its_lease<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let abandon = async |order: &str, lease| {
            let mut tx = t.begin().await;
            let op = t
                .idem
                .operation("place_order", order)
                .fingerprint(&1i64)
                .lease(lease)
                .retain(DAY);
            match op
                .begin_tx::<_, i64, Failure>(DB::tx(&mut tx))
                .await
                .unwrap()
            {
                TxStep::Run(guard) => drop(guard),
                TxStep::Replay(_) => panic!("a fresh key replayed"),
            }
            tx.commit().await.unwrap();
        };
        let lease = Duration::from_millis(300);
        let past_lease = lease + Duration::from_millis(200);
        let short = fresh("abandon");
        abandon(&short, lease).await;
        // Within the lease a duplicate is refused: shown on a claim leased for a minute,
        // so no slow commit or claim can see it lapse first.
        let long = fresh("abandonl");
        abandon(&long, Duration::from_secs(60)).await;
        let mut tx = t.begin().await;
        let r = place(t, &mut tx, &long, 1, false).await;
        assert!(
            matches!(r, Err(Failure::Idem(IdemError::InFlight { .. }))),
            "{r:?}"
        );
        tx.rollback().await.unwrap();
        // Past the lease the short claim is taken over (any later, all the more).
        tokio::time::sleep(past_lease).await;
        assert_eq!(place_committed(t, &short, 1).await.unwrap(), 100);
        assert_eq!(t.rows(&short).await.len(), 1);

        let leased = fresh("abandonr");
        abandon(&leased, lease).await;
        tokio::time::sleep(past_lease).await;
        let (v, info) = crate::observe(
            t.idem
                .operation("place_order", leased.as_str())
                .fingerprint(&1i64)
                .retain(DAY)
                .run(|| async { Ok::<_, Failure>(7i64) }),
        )
        .await;
        assert_eq!(v.unwrap(), 7);
        assert!(
            info.epoch().is_some(),
            "the leased call did not run the body"
        );
    }

    /// With `errors = record`, a body whose own SQL failed (which aborts a PostgreSQL
    /// transaction) still gets its error recorded and returned, never a store error in
    /// its place; the next call replays it.
    pub async fn recorded_error_after_the_body_sql_failed<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("sqlerr");
        let taken = format!("{order}#taken");
        let mut tx = t.begin().await;
        t.insert(&mut tx, &taken, 1).await.unwrap();
        tx.commit().await.unwrap();
        for attempt in 0..2 {
            let mut tx = t.begin().await;
            let op = t
                .idem
                .operation("place_order", order.as_str())
                .fingerprint(&2i64)
                .record_errors()
                .retain(DAY);
            let r: Result<i64, Failure> = match op.begin_tx(DB::tx(&mut tx)).await.unwrap() {
                TxStep::Replay(out) => {
                    assert_eq!(attempt, 1, "replayed on the first call");
                    out
                }
                TxStep::Run(guard) => {
                    assert_eq!(attempt, 0, "ran again after the error was recorded");
                    // A duplicate primary key: the body's own statement fails.
                    let out = t
                        .insert(&mut tx, &taken, 2)
                        .await
                        .map(|()| 0)
                        .map_err(|_| Failure::Declined("duplicate order".into()));
                    guard.finish(DB::tx(&mut tx), out).await
                }
            };
            assert!(
                matches!(&r, Err(Failure::Declined(m)) if m == "duplicate order"),
                "{r:?}"
            );
            tx.commit().await.unwrap();
        }
        assert_eq!(t.rows(&order).await, [(taken, 1)]);
    }

    /// An outcome past its retention is absent in transactional mode too: another
    /// payload claims the key and runs.
    pub async fn expired_outcome_is_claimed_afresh<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("expired");
        let recorded = t
            .idem
            .operation("place_order", order.as_str())
            .fingerprint(&1i64)
            .retain(Duration::from_millis(1))
            .run(|| async { Ok::<_, Failure>(100i64) })
            .await;
        assert_eq!(recorded.unwrap(), 100);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            place_committed(t, &order, 2).await.unwrap(),
            200,
            "an expired outcome was answered"
        );
        assert_eq!(t.rows(&order).await, [(order, 2)]);
    }

    /// An UNKNOWN operation (a leased body's error classified unknown) is answered as
    /// such in a transaction, at its epoch; the body does not run.
    pub async fn unknown_is_answered_in_a_transaction<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let order = fresh("unknown");
        let (r, info) = crate::observe(
            t.idem
                .operation("place_order", order.as_str())
                .fingerprint(&1i64)
                .retain(DAY)
                .classify(|_: &Failure| Disposition::Unknown)
                .run(|| async { Err::<i64, _>(Failure::Timeout) }),
        )
        .await;
        assert!(matches!(r, Err(Failure::Timeout)), "{r:?}");
        assert!(info.unknown(), "{info:?}");
        let mut tx = t.begin().await;
        let r = place(t, &mut tx, &order, 1, false).await;
        assert!(
            matches!(r, Err(Failure::Idem(IdemError::Unknown { epoch, .. })) if Some(epoch) == info.epoch()),
            "{r:?}, the leased call ran at {:?}",
            info.epoch()
        );
        tx.rollback().await.unwrap();
        assert_eq!(t.rows(&order).await, []);
    }

    /// The seeds [`model_random_schedules`] runs: `IDEM_MODEL_SEED` replays one,
    /// `IDEM_MODEL_RUNS` runs that many (3 by default).
    pub fn model_seeds() -> Vec<u64> {
        if let Ok(seed) = std::env::var("IDEM_MODEL_SEED") {
            return vec![seed.parse().expect("IDEM_MODEL_SEED is a number")];
        }
        let runs = std::env::var("IDEM_MODEL_RUNS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(3);
        (1..=runs).collect()
    }

    /// Random schedules of transactional calls on a few keys, one per seed of
    /// [`model_seeds`]: callers commit or roll back, bodies fail with a released error,
    /// roll back to idem's own savepoint, or are cancelled mid-way. Whatever the
    /// schedule, each key commits at most one body's writes, and every committed `Ok`
    /// answer is that body's value.
    pub async fn model_random_schedules<DB>(t: &TxTarget<DB>)
    where
        DB: TxDatabase,
    {
        let seeds = model_seeds();
        for &seed in &seeds {
            model_schedule(t, seed).await;
        }
        use std::io::Write;
        // Uncaptured, so a passing run says which seeds it covered.
        let _ = writeln!(
            std::io::stderr(),
            "transactional model on {}: {} schedules of 4 callers x 8 steps passed, seeds {seeds:?}",
            DB::NAME,
            seeds.len()
        );
    }

    async fn model_schedule<DB>(t: &TxTarget<DB>, seed: u64)
    where
        DB: TxDatabase,
    {
        let base = fresh(&format!("m{seed}"));
        // (key, value answered, whether the caller committed)
        let answers = Arc::new(std::sync::Mutex::new(Vec::<(String, i64, bool)>::new()));
        let callers: Vec<_> = (0..4u64)
            .map(|caller| {
                let (t, base, answers) = (t.clone(), base.clone(), answers.clone());
                tokio::spawn(async move {
                    let mut rng = fastrand::Rng::with_seed(seed * 100 + caller);
                    for step in 0..8u64 {
                        let key = format!("{base}k{}", rng.u32(0..3));
                        let behavior = rng.u32(0..100);
                        let cancel_after = Duration::from_micros(rng.u64(0..3000));
                        let cancellable = (90..100).contains(&behavior);
                        let mut tx = if cancellable {
                            t.begin_cancellable().await
                        } else {
                            t.begin().await
                        };
                        let op = t
                            .idem
                            .operation("tx_model", key.as_str())
                            .fingerprint_none()
                            .retain(Duration::from_secs(3600))
                            .lease(Duration::from_millis(300));
                        let value = (caller * 100 + step) as i64;
                        let call = async {
                            let guard =
                                match op.begin_tx::<_, i64, Failure>(DB::tx(&mut tx)).await? {
                                    TxStep::Replay(out) => return out,
                                    TxStep::Run(g) => g,
                                };
                            let undo = format!("ROLLBACK TO SAVEPOINT {}", guard.savepoint());
                            let body = async {
                                if (60..70).contains(&behavior) {
                                    // The body undoes idem's claim along with its own work.
                                    DB::execute(&mut *tx, undo)
                                        .await
                                        .map_err(|e| Failure::Declined(e.to_string()))?;
                                }
                                let id = format!("{key}#{caller}#{step}");
                                t.insert(&mut tx, &id, value)
                                    .await
                                    .map_err(|e| Failure::Declined(e.to_string()))?;
                                if (40..60).contains(&behavior) {
                                    return Err(Failure::Timeout);
                                }
                                Ok(value)
                            }
                            .await;
                            guard.finish(DB::tx(&mut tx), body).await
                        };
                        let out = if cancellable {
                            match tokio::time::timeout(cancel_after, call).await {
                                Ok(out) => out,
                                Err(_) => {
                                    (t.abandon)(tx).await;
                                    continue;
                                }
                            }
                        } else {
                            call.await
                        };
                        // A caller keeps its transaction only for a success or the
                        // released error the contract lets it commit after; 70..90 roll
                        // back whatever the answer.
                        let commit = matches!(out, Ok(_) | Err(Failure::Timeout))
                            && !(70..90).contains(&behavior)
                            && !cancellable;
                        let committed = if commit {
                            tx.commit().await.is_ok()
                        } else {
                            let _ = tx.rollback().await;
                            false
                        };
                        if let Ok(v) = out {
                            answers.lock().unwrap().push((key, v, committed));
                        }
                    }
                })
            })
            .collect();
        for caller in callers {
            caller.await.unwrap();
        }
        let mut by_key = std::collections::HashMap::<String, Vec<i64>>::new();
        let sql = format!("SELECT id, qty FROM {} WHERE id LIKE '{base}k%'", t.table);
        for (id, qty) in DB::rows(&t.pool, sql).await.unwrap() {
            let key = id.split('#').next().unwrap().to_owned();
            by_key.entry(key).or_default().push(qty);
        }
        let mut violations = Vec::new();
        for (key, values) in &by_key {
            if values.len() > 1 {
                violations.push(format!(
                    "key {key} committed {} bodies' writes: {values:?}",
                    values.len()
                ));
            }
        }
        for (key, v, committed) in answers.lock().unwrap().iter() {
            let written = by_key.get(key).map(Vec::as_slice).unwrap_or(&[]);
            if *committed && written != [*v] {
                violations.push(format!(
                    "key {key} answered {v} and committed, but its writes are {written:?}"
                ));
            }
        }
        assert!(
            violations.is_empty(),
            "transactional model on {}, seed {seed} (rerun with IDEM_MODEL_SEED={seed}):\n{}",
            DB::NAME,
            violations.join("\n")
        );
    }
}
