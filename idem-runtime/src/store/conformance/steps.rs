//! The store suite's checks of [steps](mod@crate::step): recorded under their claim's
//! epoch and fenced, resumed by a takeover or after a release, kept for the operator,
//! and gone with their operation or their life of it.

use std::time::Duration;

use super::{
    DAY, FP, LEASE, OTHER_FP, PAST_TINY, TINY, acquire, claim, claim_with, fresh_id, outcome,
};
use crate::store::{Claim, Fence, OperationId, State, Store, Takeover};

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
