//! [`Delegate`]: a store that wraps another and forwards what it does not change.

use std::sync::Arc;
use std::time::Duration;

use super::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail,
    RecordInfo, Stats, StepRecord, Store, StoreError, StoreFuture, StoredOutcome, WakeHub,
};

/// A wrapper around another [`Store`] (metrics, tracing, fault injection) that
/// overrides only the methods it changes: every method is the [`Store`] or [`Admin`]
/// method of the same name, written as an `async fn`, and by default forwards to that
/// method of [`inner`](Delegate::inner), defaults included (`get`, `forget`,
/// `attach_wakers`, ...), so the wrapper keeps whatever the inner store can do. Through
/// a wrapper every call is a boxed future, so the wrapper sees each one.
///
/// A `dyn Delegate` is a [`Store`]: pass an `Arc<dyn Delegate>` or `Box<dyn Delegate>`
/// to [`IdemBuilder::store`](crate::IdemBuilder::store), or return one, in an `Arc`,
/// from [`IdemBuilder::layer`](crate::IdemBuilder::layer). Implement it with
/// [`async_trait`](https://docs.rs/async-trait), as [`Store`] is.
///
/// ```
/// use idem_runtime::store::{Claim, ClaimRequest, Delegate, MemoryStore, Store, StoreError};
/// use idem_runtime::{Idem, IdemError};
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
///
/// /// Counts claims; everything else is the memory store's.
/// #[derive(Default)]
/// struct CountClaims {
///     inner: MemoryStore,
///     claims: AtomicU64,
/// }
///
/// #[async_trait::async_trait]
/// impl Delegate for CountClaims {
///     fn inner(&self) -> &dyn Store {
///         &self.inner
///     }
///
///     async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
///         self.claims.fetch_add(1, Ordering::Relaxed);
///         self.inner.claim(req).await
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let counted = Arc::new(CountClaims::default());
/// let idem = Idem::builder().store(counted.clone() as Arc<dyn Delegate>);
/// let op = idem
///     .operation("charge", "order-1")
///     .retain(Duration::from_secs(3600))
///     .fingerprint_none();
/// let id = op.id().clone();
/// assert_eq!(op.run(|| async { Ok::<_, IdemError>(42) }).await?, 42);
/// assert_eq!(counted.claims.load(Ordering::Relaxed), 1);
/// // The rest reached the memory store unchanged: the record, and `get`, which the
/// // memory store implements and `Store`'s default does not.
/// assert!(idem.get(&id).await?.is_some());
/// # Ok(()) }
/// ```
#[async_trait::async_trait]
pub trait Delegate: Send + Sync + 'static {
    /// The store this one wraps, which every method not overridden forwards to.
    fn inner(&self) -> &dyn Store;

    /// [`Store::claim`], forwarded by default.
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.inner().claim(req).await
    }

    /// [`Store::peek_completed`], forwarded by default.
    async fn peek_completed(
        &self,
        id: &OperationId,
        fingerprint: &[u8; 32],
    ) -> Result<Option<Result<StoredOutcome, Mismatched>>, StoreError> {
        self.inner().peek_completed(id, fingerprint).await
    }

    /// [`Store::record`], forwarded by default.
    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        self.inner().record(id, epoch, outcome, retain).await
    }

    /// [`Store::release`], forwarded by default.
    async fn release(
        &self,
        id: &OperationId,
        epoch: u64,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        self.inner().release(id, epoch, retain).await
    }

    /// [`Store::mark_unknown`], forwarded by default.
    async fn mark_unknown(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.inner().mark_unknown(id, epoch).await
    }

    /// [`Store::renew`], forwarded by default.
    async fn renew(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        self.inner().renew(id, epoch, lease).await
    }

    /// [`Admin::resolve`], forwarded by default.
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        self.inner().resolve(id, epoch, completed).await
    }

    /// [`Store::record_step`], forwarded by default.
    async fn record_step(
        &self,
        id: &OperationId,
        epoch: u64,
        label: &str,
        outcome: &StoredOutcome,
    ) -> Result<Fence, StoreError> {
        self.inner().record_step(id, epoch, label, outcome).await
    }

    /// [`Store::steps`], forwarded by default.
    async fn steps(&self, id: &OperationId) -> Result<Vec<StepRecord>, StoreError> {
        self.inner().steps(id).await
    }

    /// [`Admin::forget`], forwarded by default.
    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.inner().forget(id, epoch).await
    }

    /// [`Admin::purge_expired`], forwarded by default.
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner().purge_expired().await
    }

    /// [`Admin::stats`], forwarded by default.
    async fn stats(&self) -> Result<Stats, StoreError> {
        self.inner().stats().await
    }

    /// [`Admin::list`], forwarded by default.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner().list(filter).await
    }

    /// [`Admin::get`], forwarded by default.
    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        self.inner().get(id).await
    }

    /// [`Store::announce_wait`], forwarded by default.
    async fn announce_wait(&self, id: &OperationId) -> Result<(), StoreError> {
        self.inner().announce_wait(id).await
    }

    /// [`Store::attach_wakers`], forwarded by default.
    fn attach_wakers(&self, hub: Arc<WakeHub>) {
        self.inner().attach_wakers(hub)
    }

    /// [`Store::read_before_claims`], forwarded by default.
    fn read_before_claims(&self) {
        self.inner().read_before_claims()
    }

    /// [`Store::shares_claim_counts`], forwarded by default.
    fn shares_claim_counts(&self) -> bool {
        self.inner().shares_claim_counts()
    }

    /// [`Store::take_claim_token`], forwarded by default.
    async fn take_claim_token(
        &self,
        key: &str,
        burst: u32,
        every: Duration,
    ) -> Result<Option<Duration>, StoreError> {
        self.inner().take_claim_token(key, burst, every).await
    }
}

// On `dyn Delegate` rather than every `T: Delegate`: that blanket impl would overlap
// the one for `Box<S>`, since `Box` is fundamental and other crates may implement
// `Delegate` for `Box<TheirType>`.
impl Store for dyn Delegate {
    fn claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
    ) -> StoreFuture<'a, Result<Claim, StoreError>> {
        Delegate::claim(self, req).into()
    }

    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        Delegate::peek_completed(self, id, fingerprint).into()
    }

    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        Delegate::record(self, id, epoch, outcome, retain).into()
    }

    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        Delegate::release(self, id, epoch, retain).into()
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        Delegate::mark_unknown(self, id, epoch).into()
    }

    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        Delegate::renew(self, id, epoch, lease).into()
    }

    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        Delegate::record_step(self, id, epoch, label, outcome).into()
    }

    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        Delegate::steps(self, id).into()
    }

    fn announce_wait<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<(), StoreError>> {
        Delegate::announce_wait(self, id).into()
    }

    fn attach_wakers(&self, hub: Arc<WakeHub>) {
        Delegate::attach_wakers(self, hub)
    }

    fn read_before_claims(&self) {
        Delegate::read_before_claims(self)
    }

    fn shares_claim_counts(&self) -> bool {
        Delegate::shares_claim_counts(self)
    }

    fn take_claim_token<'a>(
        &'a self,
        key: &'a str,
        burst: u32,
        every: Duration,
    ) -> StoreFuture<'a, Result<Option<Duration>, StoreError>> {
        Delegate::take_claim_token(self, key, burst, every).into()
    }
}

#[async_trait::async_trait]
impl Admin for dyn Delegate {
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        Delegate::resolve(self, id, epoch, completed).await
    }

    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        Delegate::forget(self, id, epoch).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Delegate::purge_expired(self).await
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        Delegate::stats(self).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        Delegate::list(self, filter).await
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        Delegate::get(self, id).await
    }
}
