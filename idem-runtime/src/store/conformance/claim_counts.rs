//! A store that shares claim counts ([`Store::take_claim_token`]): GCRA by the store's
//! clock, one key's allowance apart from another's, refusals that take nothing.

use std::time::Duration;

use super::fresh_id;
use crate::store::Store;

/// A key's burst is allowed at once and the next claim refused with a wait of at most
/// one interval; another key is untouched; a refusal takes nothing, so the allowance
/// comes back one interval at a time. A store that cannot share counts is skipped.
pub async fn claim_counts_allow_the_burst_then_one_an_interval(store: &dyn Store) {
    if !store.shares_claim_counts() {
        return;
    }
    let hour = Duration::from_secs(3600);
    let (a, b) = (fresh_id("claim count a").key, fresh_id("claim count b").key);
    let take = |key: &str, every| {
        let key = key.to_owned();
        async move {
            store
                .take_claim_token(&key, 3, every)
                .await
                .expect("take a claim")
        }
    };
    for n in 0..3 {
        assert_eq!(
            take(&a, hour).await,
            None,
            "claim {n} of a burst of 3 refused"
        );
    }
    let wait = take(&a, hour)
        .await
        .expect("a claim past the burst allowed");
    assert!(
        wait > hour - Duration::from_secs(60) && wait <= hour,
        "{wait:?}"
    );
    // Refused again: the refusal took nothing, so the wait is no longer.
    let again = take(&a, hour).await.expect("refused again");
    assert!(again <= wait, "{again:?} after {wait:?}");
    assert_eq!(
        take(&b, hour).await,
        None,
        "another key's allowance was spent"
    );
    // A short interval: spent, then whole again once it has passed.
    let (c, every) = (fresh_id("claim count c").key, Duration::from_millis(500));
    assert_eq!(
        store.take_claim_token(&c, 1, every).await.expect("take"),
        None
    );
    let wait = (store.take_claim_token(&c, 1, every).await.expect("take"))
        .expect("a claim past a burst of 1 allowed");
    assert!(wait <= every, "{wait:?}");
    tokio::time::sleep(every + Duration::from_millis(100)).await;
    assert_eq!(
        store.take_claim_token(&c, 1, every).await.expect("take"),
        None,
        "the allowance did not come back"
    );
}
