//! The process-local store: one mutex over a map, the same decision table as the SQL
//! stores. Its guarantee ends with the process.

use std::borrow::Borrow;
use std::collections::HashMap as StdHashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{
    Claim, ClaimRequest, Fence, ListFilter, OperationId, RecordDetail, RecordInfo, State, Stats,
    Store, StoredOutcome, Takeover,
};
use crate::error::StoreError;

/// The records' map. foldhash's seeded hasher instead of SipHash: hashing the three
/// strings of an id was a tenth of a fresh call's time, and a per-map random seed
/// still keeps keys an attacker chooses from being steered into one bucket.
type HashMap<K, V> = StdHashMap<K, V, foldhash::quality::RandomState>;

/// A record's identity as the map keeps it: scope, name and key side by side in one
/// allocation. An `OperationId` holds three, so a stored record cost two allocations
/// more, and a lookup compared through three pointers where this compares through one.
#[derive(Debug)]
struct Packed {
    text: Box<str>,
    scope_end: usize,
    name_end: usize,
}

impl Packed {
    fn new(id: &OperationId) -> Packed {
        Packed {
            text: [id.scope.as_str(), &id.name, &id.key].concat().into(),
            scope_end: id.scope.len(),
            name_end: id.scope.len() + id.name.len(),
        }
    }

    fn id(&self) -> OperationId {
        let [scope, name, key] = self.parts();
        OperationId {
            scope: scope.to_owned(),
            name: name.to_owned(),
            key: key.to_owned(),
        }
    }
}

/// Scope, name and key, from an `OperationId` or a `Packed`: the map finds a record by
/// the caller's id without packing it first (the map's keys lend themselves as this).
trait Parts {
    fn parts(&self) -> [&str; 3];
}

impl Parts for OperationId {
    fn parts(&self) -> [&str; 3] {
        [&self.scope, &self.name, &self.key]
    }
}

impl Parts for Packed {
    fn parts(&self) -> [&str; 3] {
        let (scope, rest) = self.text.split_at(self.scope_end);
        let (name, key) = rest.split_at(self.name_end - self.scope_end);
        [scope, name, key]
    }
}

// Both hash the three strings alike (each with `str`'s end marker, so the parts'
// boundaries count), which the map's borrowed lookups need.
impl Hash for dyn Parts + '_ {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.parts().hash(h);
    }
}

impl PartialEq for dyn Parts + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn Parts + '_ {}

impl Hash for Packed {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (self as &dyn Parts).hash(h);
    }
}

impl PartialEq for Packed {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
            && self.scope_end == other.scope_end
            && self.name_end == other.name_end
    }
}

impl Eq for Packed {}

impl<'a> Borrow<dyn Parts + 'a> for Packed {
    fn borrow(&self) -> &(dyn Parts + 'a) {
        self
    }
}

/// The map's key for a lookup by `id`.
fn by(id: &OperationId) -> &dyn Parts {
    id
}

#[derive(Debug)]
struct Record {
    state: State,
    epoch: u64,
    fingerprint: [u8; 32],
    lease_until: Instant,
    claimed_at: Instant,
    expires_at: Option<Instant>,
    outcome: Option<StoredOutcome>,
}

impl Record {
    fn expired(&self, now: Instant) -> bool {
        self.state == State::Completed && self.expires_at.is_some_and(|t| t <= now)
    }
}

/// The store behind [`Idem::memory`](crate::Idem::memory): records in a `HashMap` behind
/// a mutex; every method is one critical section, which
/// is what makes the claim atomic here.
#[derive(Debug, Default)]
pub struct MemoryStore {
    records: Mutex<HashMap<Packed, Record>>,
    /// The last epoch issued: every claim takes the next, so an epoch identifies one claim
    /// for all time, whatever was released, resolved or purged since.
    last_epoch: AtomicU64,
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Packed, Record>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_epoch(&self) -> u64 {
        self.last_epoch.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn fenced(
        &self,
        id: &OperationId,
        epoch: u64,
        states: &[State],
        f: impl FnOnce(&mut HashMap<Packed, Record>),
    ) -> Fence {
        let mut map = self.lock();
        match map.get(by(id)) {
            Some(r) if r.epoch == epoch && states.contains(&r.state) => {
                f(&mut map);
                Fence::Held
            }
            _ => Fence::Lost,
        }
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    // The claim answers a replay under the same lock a read would take.
    fn peeks(&self) -> bool {
        false
    }

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        let fresh = |epoch| Record {
            state: State::InProgress,
            epoch,
            fingerprint: req.fingerprint,
            lease_until: now + req.lease,
            claimed_at: now,
            expires_at: None,
            outcome: None,
        };
        let Some(rec) = map.get_mut(by(req.id)) else {
            let epoch = self.next_epoch();
            map.insert(Packed::new(req.id), fresh(epoch));
            return Ok(Claim::Acquired {
                epoch,
                takeover: false,
            });
        };
        if rec.expired(now) {
            *rec = fresh(self.next_epoch());
            return Ok(Claim::Acquired {
                epoch: rec.epoch,
                takeover: false,
            });
        }
        if rec.fingerprint != req.fingerprint {
            return Ok(Claim::Mismatch);
        }
        Ok(match rec.state {
            State::Completed => Claim::Completed(
                rec.outcome
                    .clone()
                    .expect("completed record has an outcome"),
            ),
            State::Unknown => Claim::Unknown {
                epoch: rec.epoch,
                now: false,
            },
            State::InProgress if rec.lease_until > now => Claim::InFlight {
                retry_after: rec.lease_until - now,
            },
            State::InProgress => match req.on_takeover {
                Takeover::Rerun => {
                    rec.epoch = self.next_epoch();
                    rec.lease_until = now + req.lease;
                    rec.claimed_at = now;
                    Claim::Acquired {
                        epoch: rec.epoch,
                        takeover: true,
                    }
                }
                Takeover::Unknown => {
                    rec.state = State::Unknown;
                    Claim::Unknown {
                        epoch: rec.epoch,
                        now: true,
                    }
                }
            },
        })
    }

    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        let mut map = self.lock();
        Ok(match map.get_mut(by(id)) {
            Some(r) if r.epoch == epoch && r.state == State::InProgress => {
                r.state = State::Completed;
                r.outcome = Some(outcome.clone());
                r.expires_at = Instant::now().checked_add(retain);
                Fence::Held
            }
            // This record again, retried after a reply was lost.
            Some(r)
                if r.epoch == epoch
                    && r.state == State::Completed
                    && r.outcome.as_ref() == Some(outcome) =>
            {
                Fence::Held
            }
            _ => Fence::Lost,
        })
    }

    async fn release(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        Ok(self.fenced(id, epoch, &[State::InProgress], |map| {
            map.remove(by(id));
        }))
    }

    async fn mark_unknown(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        Ok(self.fenced(id, epoch, &[State::InProgress], |map| {
            map.get_mut(by(id)).expect("checked").state = State::Unknown;
        }))
    }

    async fn renew(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        Ok(self.fenced(id, epoch, &[State::InProgress], |map| {
            map.get_mut(by(id)).expect("checked").lease_until = Instant::now() + lease;
        }))
    }

    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        Ok(self.fenced(
            id,
            epoch,
            &[State::InProgress, State::Unknown],
            |map| match completed {
                None => {
                    map.remove(by(id));
                }
                Some((outcome, retain)) => {
                    let r = map.get_mut(by(id)).expect("checked");
                    r.state = State::Completed;
                    r.outcome = Some(outcome.clone());
                    r.expires_at = Instant::now().checked_add(retain);
                }
            },
        ))
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = Instant::now();
        let mut map = self.lock();
        let before = map.len();
        map.retain(|_, r| !r.expired(now));
        Ok((before - map.len()) as u64)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let now = Instant::now();
        let map = self.lock();
        let mut s = Stats::default();
        for r in map.values() {
            let age = now - r.claimed_at;
            s.count(r.state, age);
        }
        Ok(s)
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let now = Instant::now();
        let map = self.lock();
        Ok(map.get(by(id)).map(|r| RecordDetail {
            info: RecordInfo {
                id: id.clone(),
                state: r.state,
                epoch: r.epoch,
                age: now - r.claimed_at,
            },
            lease_remaining: (r.state == State::InProgress)
                .then(|| r.lease_until.saturating_duration_since(now)),
            expires_in: (r.state == State::Completed).then(|| {
                r.expires_at
                    .map_or(Duration::MAX, |t| t.saturating_duration_since(now))
            }),
            outcome: r.outcome.clone(),
        }))
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let now = Instant::now();
        let map = self.lock();
        let mut rows: Vec<RecordInfo> = map
            .iter()
            .filter(|(id, r)| {
                filter.state.is_none_or(|s| s == r.state)
                    && filter.name.as_deref().is_none_or(|n| n == id.parts()[1])
                    && filter.scope.as_deref().is_none_or(|s| s == id.parts()[0])
                    && filter.older_than.is_none_or(|a| now - r.claimed_at > a)
            })
            .map(|(id, r)| RecordInfo {
                id: id.id(),
                state: r.state,
                epoch: r.epoch,
                age: now - r.claimed_at,
            })
            .collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.age));
        rows.truncate(filter.limit() as usize);
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_support::*;

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
        assert_eq!(store.release(&ab_c, first).await.unwrap(), Fence::Held);
        assert!(store.get(&ab_c).await.unwrap().is_none());
        assert_eq!(store.get(&a_bc).await.unwrap().unwrap().info.epoch, second);
    }
}
