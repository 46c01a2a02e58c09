//! The process-local store: one mutex over a map, the same decision table as the SQL
//! stores. Its guarantee ends with the process.

use std::collections::HashMap as StdHashMap;
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
    records: Mutex<HashMap<OperationId, Record>>,
    /// The last epoch issued: every claim takes the next, so an epoch identifies one claim
    /// for all time, whatever was released, resolved or purged since.
    last_epoch: AtomicU64,
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<OperationId, Record>> {
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
        f: impl FnOnce(&mut HashMap<OperationId, Record>),
    ) -> Fence {
        let mut map = self.lock();
        match map.get(id) {
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
        let Some(rec) = map.get_mut(req.id) else {
            let epoch = self.next_epoch();
            map.insert(req.id.clone(), fresh(epoch));
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
        Ok(match map.get_mut(id) {
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
            map.remove(id);
        }))
    }

    async fn mark_unknown(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        Ok(self.fenced(id, epoch, &[State::InProgress], |map| {
            map.get_mut(id).expect("checked").state = State::Unknown;
        }))
    }

    async fn renew(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        Ok(self.fenced(id, epoch, &[State::InProgress], |map| {
            map.get_mut(id).expect("checked").lease_until = Instant::now() + lease;
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
                    map.remove(id);
                }
                Some((outcome, retain)) => {
                    let r = map.get_mut(id).expect("checked");
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
        Ok(map.get(id).map(|r| RecordDetail {
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
                    && filter.name.as_deref().is_none_or(|n| n == id.name)
                    && filter.scope.as_deref().is_none_or(|s| s == id.scope)
                    && filter.older_than.is_none_or(|a| now - r.claimed_at > a)
            })
            .map(|(id, r)| RecordInfo {
                id: id.clone(),
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
