//! New claims rate-limited apart from replays: [`ClaimLimit`], set with
//! [`IdemBuilder::limit_new_claims`](crate::IdemBuilder::limit_new_claims).
//!
//! A replay costs one read; a new claim costs a write, a lease and a body run. The
//! limiter is consulted only by a call that found no completed outcome, just before it
//! would write a claim, and refuses only a call that would create a record: over the
//! limit, a duplicate of a call in flight, a takeover of a lapsed claim and a mismatch
//! still get their answers. A refused call writes nothing and fails with
//! [`IdemError::RateLimited`](crate::IdemError::RateLimited).
//!
//! The count is a GCRA (the `governor` crate's, per process), or one kept in the store
//! with [`ClaimLimit::shared`] so that every instance draws from the same allowance.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use governor::clock::Clock;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use crate::bounded::bounded;
use crate::error::IdemError;
use crate::metrics;
use crate::store::{OperationId, Store, StoreError};

/// What a limiter counts by: the key a call's claim is charged to.
type KeyFn = dyn Fn(&OperationId) -> String + Send + Sync;

/// How many new claims a caller may make: `burst` at once, then one more every `every`
/// (a token bucket, as GCRA computes it), counted per scope unless
/// [`keyed_by`](Self::keyed_by) says otherwise.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{ClaimLimit, Idem};
///
/// // Each scope (a tenant, a user) may start 20 new operations at once, then one more
/// // every 3 seconds; replays of its completed operations are never counted.
/// let idem = Idem::builder()
///     .limit_new_claims(ClaimLimit::new(20, Duration::from_secs(3)))
///     .memory();
/// # let _ = idem;
/// ```
#[derive(Clone)]
pub struct ClaimLimit {
    burst: NonZeroU32,
    every: Duration,
    key: Option<Arc<KeyFn>>,
    shared: bool,
}

impl ClaimLimit {
    /// `burst` new claims at once per scope, then one more every `every`.
    ///
    /// # Panics
    ///
    /// If `burst` is zero or `every` is zero: a limit that allows nothing, or
    /// everything, is a mistake; to allow any number of claims, set no limit.
    pub fn new(burst: u32, every: Duration) -> ClaimLimit {
        let Some(burst) = NonZeroU32::new(burst).filter(|_| !every.is_zero()) else {
            panic!(
                "ClaimLimit::new({burst}, {every:?}): both must be over zero; to allow any \
                 number of new claims, set no limit"
            );
        };
        ClaimLimit {
            burst,
            every,
            key: None,
            shared: false,
        }
    }

    /// Charges each claim to the key `key` gives for its operation instead of to its
    /// scope: `|id| id.name.clone()` limits each operation across every caller, and a
    /// function of the scope can group callers (a tenant's users). The operation's
    /// scope and key are as stored ([`OperationId`]): digests where
    /// [`hash_keys`](crate::IdemBuilder::hash_keys) is set.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::ClaimLimit;
    ///
    /// // At most 100 new refunds at once across all callers, then 10 a second.
    /// let refunds = ClaimLimit::new(100, Duration::from_millis(100)).keyed_by(|id| id.name.clone());
    /// # let _ = refunds;
    /// ```
    #[must_use]
    pub fn keyed_by(
        mut self,
        key: impl Fn(&OperationId) -> String + Send + Sync + 'static,
    ) -> ClaimLimit {
        self.key = Some(Arc::new(key));
        self
    }

    /// Keeps the count in the store, shared by every `Idem` on it (each instance of a
    /// service), rather than one count per process. The store must be able to hold it:
    /// PostgreSQL and Redis can (one statement or script per new claim, keyed by a
    /// digest of the limiter's key); opening an `Idem` with a shared limit on another
    /// store fails and says so.
    #[must_use]
    pub fn shared(mut self) -> ClaimLimit {
        self.shared = true;
        self
    }

    /// The burst: how many new claims a key may make at once.
    pub fn burst(&self) -> u32 {
        self.burst.get()
    }

    /// How often one more claim is allowed once the burst is spent.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// Whether the count is kept in the store ([`shared`](Self::shared)).
    pub fn is_shared(&self) -> bool {
        self.shared
    }
}

impl fmt::Debug for ClaimLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimLimit")
            .field("burst", &self.burst)
            .field("every", &self.every)
            .field("keyed_by", &self.key.as_ref().map(|_| "fn"))
            .field("shared", &self.shared)
            .finish()
    }
}

/// A [`ClaimLimit`] in use: the per-process count, or the way to the store's.
pub(crate) struct ClaimLimiter {
    limit: ClaimLimit,
    local: DefaultKeyedRateLimiter<String>,
    /// The count of keys past which idle ones are dropped (a key whose allowance is
    /// whole is what an unseen key gets, so dropping it changes nothing).
    prune_at: AtomicUsize,
}

/// Keys kept before the first pruning of whole allowances.
const PRUNE_AT: usize = 4096;

impl ClaimLimiter {
    pub(crate) fn new(limit: ClaimLimit) -> ClaimLimiter {
        let quota = Quota::with_period(limit.every)
            .expect("ClaimLimit::new refuses a zero period")
            .allow_burst(limit.burst);
        ClaimLimiter {
            local: RateLimiter::keyed(quota),
            limit,
            prune_at: AtomicUsize::new(PRUNE_AT),
        }
    }

    /// Takes one claim for `id`'s key: `None` when allowed, else how long until one is.
    pub(crate) async fn take(
        &self,
        id: &OperationId,
        store: &dyn Store,
    ) -> Result<Option<Duration>, StoreError> {
        let key = match &self.limit.key {
            Some(key) => key(id),
            None => id.scope.clone(),
        };
        if self.limit.shared {
            // A digest: fixed length, and no key or scope in clear text in the store.
            let digest = blake3::hash(key.as_bytes()).to_hex();
            return store
                .take_claim_token(&digest, self.limit.burst.get(), self.limit.every)
                .await;
        }
        Ok(self.take_local(key))
    }

    fn take_local(&self, key: String) -> Option<Duration> {
        let answer = self.local.check_key(&key);
        let kept = self.local.len();
        if kept >= self.prune_at.load(Ordering::Relaxed) {
            self.local.retain_recent();
            // Pruning again only once the map has doubled keeps its cost amortized.
            let next = (self.local.len() * 2).max(PRUNE_AT);
            self.prune_at.store(next, Ordering::Relaxed);
        }
        match answer {
            Ok(()) => None,
            Err(not_until) => Some(not_until.wait_time_from(self.local.clock().now())),
        }
    }
}

impl ClaimLimiter {
    /// Admits a call of `name` that found no completed outcome to its claim, taking one
    /// from its allowance. Over it, refuses only a call that would create a record: one
    /// whose operation has a live record (in flight, lapsed, UNKNOWN, or completed since
    /// the replay read) goes on to its claim, which answers it as a wait, a takeover, a
    /// replay or a mismatch without a new record.
    pub(crate) async fn admit(
        &self,
        store: &dyn Store,
        timeout: Duration,
        id: &OperationId,
        name: &str,
    ) -> Result<(), Limited> {
        let taken = bounded(timeout, "claim limit", self.take(id, store));
        let Some(retry_after) = taken.await.map_err(Limited::Store)? else {
            return Ok(());
        };
        let live = match bounded(timeout, "claim limit read", store.get(id)).await {
            Ok(Some(detail)) => detail.expires_in != Some(Duration::ZERO),
            Ok(None) => false,
            // A store that cannot show the record: refused, as a new claim would be.
            Err(e) => {
                tracing::debug!(error = %e, "over the claim limit; record unreadable");
                false
            }
        };
        if live {
            return Ok(());
        }
        tracing::debug!(?retry_after, "new claim refused: over the claim limit");
        metrics::count(metrics::RATE_LIMITED, name);
        Err(Limited::Refused(IdemError::RateLimited {
            name: name.to_owned(),
            retry_after,
        }))
    }
}

/// Why a call did not get a claim from its allowance.
pub(crate) enum Limited {
    /// Over the limit, and the call would have created a record.
    Refused(IdemError),
    /// The store holding a shared count, or showing the record, failed.
    Store(StoreError),
}

impl fmt::Debug for ClaimLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimLimiter")
            .field("limit", &self.limit)
            .field("keys", &self.local.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn id(scope: &str, key: &str) -> OperationId {
        OperationId {
            scope: scope.into(),
            name: "op".into(),
            key: key.into(),
        }
    }

    #[tokio::test]
    async fn a_scope_gets_its_burst_then_waits_and_others_are_untouched() {
        let store = MemoryStore::default();
        let limiter = ClaimLimiter::new(ClaimLimit::new(2, Duration::from_secs(3600)));
        for key in ["a", "b"] {
            assert_eq!(limiter.take(&id("alice", key), &store).await.unwrap(), None);
        }
        let wait = limiter.take(&id("alice", "c"), &store).await.unwrap();
        assert!(
            wait.is_some_and(|w| w > Duration::from_secs(3000)),
            "{wait:?}"
        );
        assert_eq!(limiter.take(&id("bob", "a"), &store).await.unwrap(), None);
    }

    #[tokio::test]
    async fn keyed_by_charges_the_chosen_key() {
        let store = MemoryStore::default();
        let limit = ClaimLimit::new(1, Duration::from_secs(3600)).keyed_by(|id| id.name.clone());
        let limiter = ClaimLimiter::new(limit);
        assert_eq!(limiter.take(&id("alice", "a"), &store).await.unwrap(), None);
        // Another scope, the same operation: the same allowance.
        assert!(
            limiter
                .take(&id("bob", "b"), &store)
                .await
                .unwrap()
                .is_some()
        );
    }

    #[tokio::test]
    async fn idle_keys_are_dropped_once_many_are_kept() {
        let store = MemoryStore::default();
        let limiter = ClaimLimiter::new(ClaimLimit::new(1, Duration::from_nanos(1)));
        for n in 0..PRUNE_AT * 3 {
            let _ = limiter
                .take(&id(&n.to_string(), "k"), &store)
                .await
                .unwrap();
        }
        assert!(
            limiter.local.len() < PRUNE_AT * 3,
            "{}",
            limiter.local.len()
        );
    }

    #[test]
    #[should_panic(expected = "both must be over zero")]
    fn a_zero_limit_is_refused() {
        let _ = ClaimLimit::new(0, Duration::from_secs(1));
    }
}
