//! The process-local store: one mutex over a map, the same decision table as the SQL
//! stores. Its guarantee ends with the process.

use std::hash::BuildHasher;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hashbrown::HashTable;

use super::packed::Packed;
use super::record::{Record, Tick};
use super::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail,
    RecordInfo, State, Stats, StepRecord, Store, StoreFuture, StoredOutcome,
};
use crate::error::StoreError;

/// The records, each filed with its identity's hash beside it: the table grows without
/// hashing (or reading) a stored identity again, which would cost a tenth of a fresh
/// call's time in a store of a million records. foldhash with a per-store random seed,
/// not SipHash: hashing an id's three strings with SipHash costs another tenth, and the
/// seed still keeps keys an attacker chooses from being steered into one bucket.
#[derive(Default)]
struct Records {
    table: HashTable<Slot>,
    hasher: foldhash::quality::RandomState,
}

struct Slot {
    hash: u64,
    id: Packed,
    rec: Record,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("len", &self.table.len())
            .finish()
    }
}

impl Records {
    /// `id`'s hash, and the test that a slot is `id`'s (the hash first, the text only
    /// where it matches).
    fn key<'a>(&self, id: &'a OperationId) -> (u64, impl Fn(&Slot) -> bool + 'a) {
        let hash = self.hasher.hash_one([&id.scope, &id.name, &id.key]);
        (hash, move |e: &Slot| e.hash == hash && e.id.is(id))
    }

    fn get(&self, id: &OperationId) -> Option<&Record> {
        let (hash, is) = self.key(id);
        self.table.find(hash, is).map(|e| &e.rec)
    }

    fn get_mut(&mut self, id: &OperationId) -> Option<&mut Record> {
        let (hash, is) = self.key(id);
        self.table.find_mut(hash, is).map(|e| &mut e.rec)
    }

    fn remove(&mut self, id: &OperationId) -> Option<Record> {
        let (hash, is) = self.key(id);
        let found = self.table.find_entry(hash, is);
        found.ok().map(|e| e.remove().0.rec)
    }

    /// `id`'s record, or `make`'s, filed under `id` when it has none (`true` then).
    fn get_or_insert(
        &mut self,
        id: &OperationId,
        make: impl FnOnce() -> Record,
    ) -> (&mut Record, bool) {
        use hashbrown::hash_table::Entry;
        let (hash, is) = self.key(id);
        match self.table.entry(hash, is, |e| e.hash) {
            Entry::Occupied(e) => (&mut e.into_mut().rec, false),
            Entry::Vacant(v) => {
                let id = Packed::new(id);
                let slot = v.insert(Slot {
                    hash,
                    id,
                    rec: make(),
                });
                (&mut slot.into_mut().rec, true)
            }
        }
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn retain(&mut self, mut keep: impl FnMut(&Record) -> bool) {
        self.table.retain(|e| keep(&e.rec));
    }

    fn iter(&self) -> impl Iterator<Item = (&Packed, &Record)> {
        self.table.iter().map(|e| (&e.id, &e.rec))
    }

    fn values(&self) -> impl Iterator<Item = &Record> {
        self.table.iter().map(|e| &e.rec)
    }
}

/// The store behind [`Idem::memory`](crate::Idem::memory): records in a hash table
/// behind a mutex; every method is one critical section, which is what makes the claim
/// atomic here.
#[derive(Debug)]
pub struct MemoryStore {
    records: Mutex<Records>,
    /// What the records' instants count from.
    base: Instant,
    /// The last epoch issued: every claim takes the next, so an epoch identifies one claim
    /// for all time, whatever was released, resolved or purged since.
    last_epoch: AtomicU64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            records: Mutex::default(),
            base: Instant::now(),
            last_epoch: AtomicU64::default(),
        }
    }
}

impl MemoryStore {
    /// `at` as the records file it.
    fn tick(&self, at: Instant) -> Tick {
        Tick(0).after(at.saturating_duration_since(self.base))
    }

    fn now(&self) -> Tick {
        self.tick(Instant::now())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_epoch(&self) -> u64 {
        self.last_epoch.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Records `outcome`, sharing its body with the replays that read it.
    fn record_now(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Fence {
        let expires_at = self.now().after(retain);
        let mut map = self.lock();
        match map
            .get_mut(id)
            .and_then(|r| r.record(epoch, outcome, expires_at))
        {
            Some(_) => Fence::Held,
            None => Fence::Lost,
        }
    }

    fn decide(&self, req: &ClaimRequest<'_>) -> Claim {
        let now = self.now();
        let mut map = self.lock();
        let (rec, new) = map.get_or_insert(req.id, || Record::fresh(req, now, self.next_epoch()));
        if new {
            return Claim::Acquired {
                epoch: rec.epoch,
                takeover: false,
                resume: false,
            };
        }
        rec.claim(req, now, || self.next_epoch())
    }

    /// Runs `f` if `holds` says the record of `id` is held at `epoch` (`Record::held_by`
    /// for a claim's own writes, `Record::settles_at` for an operator's).
    fn fenced(
        &self,
        id: &OperationId,
        epoch: u64,
        holds: fn(&Record, u64) -> bool,
        f: impl FnOnce(&mut Records),
    ) -> Fence {
        let mut map = self.lock();
        match map.get(id) {
            Some(r) if holds(r, epoch) => {
                f(&mut map);
                Fence::Held
            }
            _ => Fence::Lost,
        }
    }
}

// Every answer is made under the lock, on the caller's thread: ready at once, with
// nothing to box or time.
impl Store for MemoryStore {
    fn claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
    ) -> StoreFuture<'a, Result<Claim, StoreError>> {
        StoreFuture::ready(Ok(self.decide(req)))
    }

    // The claim would answer a replay as cheaply, but a read tells a replay from a call
    // that may create a record before the claim limit counts it.
    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        let now = self.now();
        let map = self.lock();
        let read = map.get(id).and_then(|rec| rec.peek(fingerprint, now));
        StoreFuture::ready(Ok(read))
    }

    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::ready(Ok(self.record_now(id, epoch, outcome, retain)))
    }

    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        let expires_at = self.now().after(retain);
        StoreFuture::ready(Ok(self.fenced(id, epoch, Record::held_by, |map| {
            if map.get_mut(id).expect("checked").release(expires_at) {
                map.remove(id);
            }
        })))
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::ready(Ok(self.fenced(id, epoch, Record::held_by, |map| {
            map.get_mut(id).expect("checked").state = State::Unknown;
        })))
    }

    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::ready(Ok(self.fenced(id, epoch, Record::held_by, |map| {
            map.get_mut(id).expect("checked").lease_until = self.now().after(lease);
        })))
    }

    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        let at = self.now();
        let mut map = self.lock();
        let held = map
            .get_mut(id)
            .is_some_and(|r| r.record_step(epoch, label, outcome, at));
        StoreFuture::ready(Ok(if held { Fence::Held } else { Fence::Lost }))
    }

    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        let now = self.now();
        let map = self.lock();
        StoreFuture::ready(Ok(map.get(id).map_or_else(Vec::new, |r| r.steps(now))))
    }
}

#[async_trait::async_trait]
impl Admin for MemoryStore {
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        Ok(
            self.fenced(id, epoch, Record::settles_at, |map| match completed {
                None => {
                    let expires_at = self.now().after(super::RESUME_WINDOW);
                    if map.get_mut(id).expect("checked").release(expires_at) {
                        map.remove(id);
                    }
                }
                Some((outcome, retain)) => {
                    let expires_at = self.now().after(retain);
                    map.get_mut(id)
                        .expect("checked")
                        .complete(outcome.clone(), expires_at);
                }
            }),
        )
    }

    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        let now = self.now();
        let mut map = self.lock();
        match map.get(id) {
            Some(r) if r.epoch == epoch && r.forgettable(now) => {
                map.remove(id);
                Ok(Fence::Held)
            }
            _ => Ok(Fence::Lost),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = self.now();
        let mut map = self.lock();
        let before = map.len();
        map.retain(|r| !r.expired(now));
        Ok((before - map.len()) as u64)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let now = self.now();
        let map = self.lock();
        let mut s = Stats::default();
        for r in map.values() {
            let age = now.since(r.claimed_at);
            s.count(r.state, r.released(), age);
        }
        Ok(s)
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let now = self.now();
        let map = self.lock();
        Ok(map.get(id).map(|r| r.detail(id.clone(), now)))
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let now = self.now();
        let map = self.lock();
        let mut rows: Vec<RecordInfo> = map
            .iter()
            .filter(|(id, r)| {
                let [scope, name, _] = id.parts();
                r.listed(filter, now)
                    && filter.name.as_deref().is_none_or(|n| n == name)
                    && filter.scope.as_deref().is_none_or(|s| s == scope)
            })
            .map(|(id, r)| r.info(id.id(), now))
            .collect();
        super::sort_listed(&mut rows, filter);
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_support::*;

    /// A retention too long to count never expires (it saturates, it does not wrap),
    /// and a lease's remainder counts down from the store's own clock.
    #[tokio::test]
    async fn an_endless_retention_never_expires() {
        let store = MemoryStore::default();
        let id = OperationId {
            scope: String::new(),
            name: "op".into(),
            key: "k".into(),
        };
        let epoch = epoch_of(claim(&store, &id, FP, LEASE).await);
        let detail = store.get(&id).await.unwrap().unwrap();
        let left = detail.lease_remaining.expect("in progress");
        assert!(left <= LEASE && left > LEASE / 2, "{left:?} of {LEASE:?}");
        let outcome = StoredOutcome {
            is_err: false,
            version: 1,
            body: b"1".to_vec().into(),
        };
        let fence = store.record(&id, epoch, &outcome, Duration::MAX).await;
        assert_eq!(fence.unwrap(), Fence::Held);
        let detail = store.get(&id).await.unwrap().unwrap();
        assert_eq!(detail.expires_in, Some(Duration::MAX));
        assert_eq!(store.purge_expired().await.unwrap(), 0);
        assert_eq!(
            claim(&store, &id, FP, LEASE).await,
            Claim::Completed(outcome)
        );
    }

    /// Ids whose parts run together into the same text are still two records, and a
    /// record is found, listed and removed by the id it was claimed under.
    #[tokio::test]
    async fn ids_that_run_together_are_distinct_records() {
        let store = MemoryStore::default();
        let ab_c = OperationId {
            scope: "ab".into(),
            name: "c".into(),
            key: "k".into(),
        };
        let a_bc = OperationId {
            scope: "a".into(),
            name: "bc".into(),
            key: "k".into(),
        };
        let first = epoch_of(claim(&store, &ab_c, FP, LEASE).await);
        let second = epoch_of(claim(&store, &a_bc, OTHER_FP, LEASE).await);
        assert_ne!(first, second);
        let listed = store.list(&ListFilter::default()).await.unwrap();
        let mut ids: Vec<_> = listed.into_iter().map(|r| r.id).collect();
        ids.sort();
        assert_eq!(ids, [a_bc.clone(), ab_c.clone()]);
        assert_eq!(
            store.release(&ab_c, first, LEASE).await.unwrap(),
            Fence::Held
        );
        assert!(store.get(&ab_c).await.unwrap().is_none());
        assert_eq!(store.get(&a_bc).await.unwrap().unwrap().info.epoch, second);
    }
}
