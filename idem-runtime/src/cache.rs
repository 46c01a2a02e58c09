//! Outcomes this process recorded, kept briefly so a retry that comes back to the same
//! process replays without a round trip to the store.
//!
//! Safe across processes: a COMPLETED record never changes until it expires (resolve
//! settles only IN_PROGRESS and UNKNOWN records, purge removes only expired ones), and an
//! entry is dropped before its record can expire: it lives at most `retain` from the
//! moment just before the record was sent, and at most [`MAX_ENTRY_LIFE`] so that a
//! paused clock or a suspended host cannot stretch it far.
//!
//! # What the budget counts
//!
//! Everything the cache holds on the heap: per entry, the key's allocation and its three
//! strings, the outcome's allocation and its body; and the hash table and the eviction
//! queue at their capacity. Each heap block is counted as glibc's `malloc` sizes it on
//! 64-bit platforms (the request plus an 8-byte header, rounded up to 16, at least 32:
//! [`block`]), so what the cache holds stays within its budget; an allocator with
//! coarser size classes can take a few bytes more per block. The table's size follows
//! the layout of std's `HashMap` (`tests/bounds_load.rs` measures it with a counting
//! allocator).
//!
//! # When entries go
//!
//! Oldest first, when an insert would take the cache past its budget; and once expired,
//! on the next insert: entries leave the queue's front while they are expired, and when
//! retentions differ (an entry expiring before one inserted earlier), a sweep of the
//! whole cache, at most once per as many inserts as the last sweep left entries, drops
//! the rest. A
//! read of an expired entry answers nothing and leaves it for those. Reads allocate
//! nothing.

use std::collections::{HashMap, VecDeque};
use std::mem::size_of;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::{OperationId, StoredOutcome};

/// Longest time an entry is trusted, whatever the retention.
const MAX_ENTRY_LIFE: Duration = Duration::from_secs(60);

/// Fewest inserts between two sweeps of the whole cache.
const SWEEP_EVERY: usize = 64;

struct Entry {
    fingerprint: [u8; 32],
    outcome: Arc<StoredOutcome>,
    expires: Instant,
}

/// What the cache knows of an operation.
pub(crate) enum Cached {
    /// Completed with this outcome, for this fingerprint.
    Replay(Arc<StoredOutcome>),
    /// Completed for another fingerprint.
    Mismatch,
}

/// One slot of the hash table.
type Slot = (Arc<OperationId>, Entry);

#[derive(Default)]
struct Inner {
    /// Keyed by the same allocation `order` holds, so a key is stored once.
    entries: HashMap<Arc<OperationId>, Entry>,
    /// Every key of `entries`, once, oldest insert first: the eviction order, and the
    /// expiry order while retentions are alike.
    order: VecDeque<Arc<OperationId>>,
    /// What the entries hold on the heap, the table and the queue aside.
    bytes: usize,
    /// The table's capacity when it last grew or was rebuilt: its allocation.
    /// (`HashMap::capacity` drops below it while removed slots await reuse.)
    table_capacity: usize,
    /// The latest expiry inserted.
    latest: Option<Instant>,
    /// An entry expires before one inserted earlier, so popping the queue's expired
    /// front may leave it behind.
    disordered: bool,
    /// Inserts since the last sweep.
    since_sweep: usize,
    /// Entries left by the last sweep: the next waits for as many inserts, so sweeps
    /// cost O(1) per insert (the entries can at most have doubled since).
    swept_len: usize,
}

/// A byte-bounded map of recently recorded outcomes, evicted oldest first.
pub(crate) struct ReplayCache {
    budget: usize,
    inner: Mutex<Inner>,
}

/// Heap bytes a request of `n` bytes takes: glibc's `malloc` on 64-bit platforms adds an
/// 8-byte header and rounds up to 16, at least 32.
const fn block(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        let chunk = (n + 8).next_multiple_of(16);
        if chunk < 32 { 32 } else { chunk }
    }
}

/// The heap an `Arc<T>` allocation takes: its two counts and the value.
const fn arc_block<T>() -> usize {
    block(2 * size_of::<usize>() + size_of::<T>())
}

/// The heap a key holds: its `Arc` and its three strings.
fn key_bytes(id: &OperationId) -> usize {
    arc_block::<OperationId>()
        + block(id.scope.capacity())
        + block(id.name.capacity())
        + block(id.key.capacity())
}

/// The heap an outcome holds: its `Arc` and its body.
fn outcome_bytes(outcome: &StoredOutcome) -> usize {
    arc_block::<StoredOutcome>() + block(outcome.body.len())
}

/// The heap of std's `HashMap` table (hashbrown's layout) of `capacity`: a power of two
/// of buckets, 7/8 of them usable (all but one below 8 buckets), each a slot and a
/// control byte, and 16 trailing control bytes.
fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        (capacity * 8).div_ceil(7)
    }
    .next_power_of_two();
    block((buckets * size_of::<Slot>()).next_multiple_of(16) + buckets + 16)
}

impl Inner {
    /// Everything the cache holds on the heap, as the budget counts it.
    fn held(&self) -> usize {
        self.bytes
            + table_bytes(self.table_capacity)
            + block(self.order.capacity() * size_of::<Arc<OperationId>>())
    }

    /// Drops the oldest entry; `false` when there is none.
    fn evict_oldest(&mut self) -> bool {
        let Some(key) = self.order.pop_front() else {
            return false;
        };
        if let Some(e) = self.entries.remove(&*key) {
            self.bytes -= key_bytes(&key) + outcome_bytes(&e.outcome);
        }
        true
    }

    /// Drops expired entries: those at the queue's front, and all of them in a sweep
    /// when the queue is out of expiry order and enough inserts came since the last.
    fn drop_expired(&mut self, now: Instant) {
        while let Some(front) = self.order.front() {
            if self.entries.get(&**front).is_some_and(|e| e.expires > now) {
                break;
            }
            self.evict_oldest();
        }
        self.since_sweep += 1;
        if self.disordered && self.since_sweep >= self.swept_len.max(SWEEP_EVERY) {
            let Inner {
                entries,
                order,
                bytes,
                ..
            } = self;
            entries.retain(|key, e| {
                let keep = e.expires > now;
                if !keep {
                    *bytes -= key_bytes(key) + outcome_bytes(&e.outcome);
                }
                keep
            });
            order.retain(|key| entries.contains_key(&**key));
            self.disordered = false;
            self.since_sweep = 0;
            self.swept_len = entries.len();
        }
        // A table left mostly empty by expiries is rebuilt smaller; it doubles again
        // only after the entries do, so the rebuilds cost O(1) per insert.
        let len = self.entries.len();
        if self.table_capacity > 4 * len.max(SWEEP_EVERY / 4) {
            let mut smaller = HashMap::with_capacity(2 * len);
            smaller.extend(self.entries.drain());
            self.entries = smaller;
            self.table_capacity = self.entries.capacity();
            self.order.shrink_to(2 * len);
        }
    }

    /// Adds or replaces `id`'s entry.
    fn insert(&mut self, id: &OperationId, entry: Entry) {
        if entry.expires < *self.latest.get_or_insert(entry.expires) {
            self.disordered = true;
        }
        self.latest = self.latest.max(Some(entry.expires));
        let added = outcome_bytes(&entry.outcome);
        if let Some(old) = self.entries.get_mut(id) {
            // The key stays, and so does its place in the queue.
            self.bytes = self.bytes - outcome_bytes(&old.outcome) + added;
            *old = entry;
            return;
        }
        self.entries.reserve(1);
        self.table_capacity = self.table_capacity.max(self.entries.capacity());
        let key = Arc::new(id.clone());
        self.bytes += key_bytes(&key) + added;
        self.order.push_back(key.clone());
        self.entries.insert(key, entry);
    }
}

impl ReplayCache {
    /// A cache holding at most `budget` bytes of memory; 0 turns it off.
    pub(crate) fn new(budget: usize) -> Self {
        ReplayCache {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn get(&self, id: &OperationId, fingerprint: &[u8; 32]) -> Option<Cached> {
        if self.budget == 0 {
            return None;
        }
        let inner = self.lock();
        let entry = inner.entries.get(id)?;
        if entry.expires <= Instant::now() {
            return None;
        }
        Some(if &entry.fingerprint == fingerprint {
            Cached::Replay(entry.outcome.clone())
        } else {
            Cached::Mismatch
        })
    }

    /// Remembers an outcome whose record was sent at `sent_at` and kept for `retain`.
    pub(crate) fn put(
        &self,
        id: &OperationId,
        fingerprint: [u8; 32],
        outcome: StoredOutcome,
        sent_at: Instant,
        retain: Duration,
    ) {
        if self.budget == 0 {
            return;
        }
        let now = Instant::now();
        let expires = sent_at + retain.min(MAX_ENTRY_LIFE);
        if expires <= now {
            return;
        }
        if key_bytes(id) + outcome_bytes(&outcome) > self.budget {
            return;
        }
        let mut inner = self.lock();
        inner.drop_expired(now);
        inner.insert(
            id,
            Entry {
                fingerprint,
                outcome: Arc::new(outcome),
                expires,
            },
        );
        while inner.held() > self.budget && inner.evict_oldest() {}
    }

    /// Drops `id`'s entry: an operator forgot the record, so it must not be replayed
    /// from here. Linear in the entries; forgetting is rare.
    pub(crate) fn forget(&self, id: &OperationId) {
        if self.budget == 0 {
            return;
        }
        let mut inner = self.lock();
        if let Some((key, e)) = inner.entries.remove_entry(id) {
            inner.bytes -= key_bytes(&key) + outcome_bytes(&e.outcome);
            inner.order.retain(|k| **k != *id);
        }
    }

    /// What the cache holds, as its budget counts it.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().held()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        let inner = self.lock();
        assert_eq!(inner.entries.len(), inner.order.len());
        inner.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(k: &str) -> OperationId {
        OperationId {
            scope: String::new(),
            name: "op".into(),
            key: k.into(),
        }
    }

    fn outcome(n: usize) -> StoredOutcome {
        StoredOutcome {
            is_err: false,
            version: 1,
            body: vec![b'x'; n].into(),
        }
    }

    /// What one entry of `outcome(n)` under key `k` costs.
    fn cost(k: &str, n: usize) -> usize {
        key_bytes(&id(k)) + outcome_bytes(&outcome(n))
    }

    #[test]
    fn replays_mismatches_expires_and_evicts() {
        // Room for the containers and about three entries of 400 bytes.
        let c = ReplayCache::new(3 * cost("a", 400) + 600);
        let now = Instant::now();
        c.put(
            &id("a"),
            [1; 32],
            outcome(400),
            now,
            Duration::from_secs(10),
        );
        assert!(matches!(c.get(&id("a"), &[1; 32]), Some(Cached::Replay(_))));
        assert!(matches!(c.get(&id("a"), &[2; 32]), Some(Cached::Mismatch)));
        // Already expired when put: never kept.
        c.put(
            &id("b"),
            [1; 32],
            outcome(10),
            now - Duration::from_secs(20),
            Duration::from_secs(10),
        );
        assert!(c.get(&id("b"), &[1; 32]).is_none());
        assert_eq!(c.len(), 1);
        // Over budget: the oldest goes.
        for k in ["c", "d", "e"] {
            c.put(&id(k), [1; 32], outcome(400), now, Duration::from_secs(10));
        }
        assert!(c.get(&id("a"), &[1; 32]).is_none());
        assert!(c.get(&id("e"), &[1; 32]).is_some());
        assert!(c.held() <= 3 * cost("a", 400) + 600, "{}", c.held());
        assert!(ReplayCache::new(0).get(&id("d"), &[1; 32]).is_none());
    }

    /// Tiny outcomes under long keys: what the budget counts is mostly keys and
    /// bookkeeping, and the cache stays within it however many come.
    #[test]
    fn the_budget_counts_keys_and_bookkeeping() {
        let budget = 64 * 1024;
        let c = ReplayCache::new(budget);
        let now = Instant::now();
        let key = |i: usize| format!("{i:0>120}");
        for i in 0..5_000 {
            c.put(
                &id(&key(i)),
                [1; 32],
                outcome(1),
                now,
                Duration::from_secs(60),
            );
            assert!(c.held() <= budget, "{} > {budget} after {i}", c.held());
        }
        let per_entry = cost(&key(0), 1);
        let kept = c.len();
        assert!(
            kept <= budget / per_entry,
            "{kept} entries of {per_entry} bytes each in {budget} bytes"
        );
        // Full, not merely small: the bookkeeping does not crowd the entries out.
        assert!(kept >= budget / (2 * per_entry), "only {kept} entries kept");
        assert!(c.get(&id(&key(4_999)), &[1; 32]).is_some());
        assert!(c.get(&id(&key(0)), &[1; 32]).is_none());
    }

    /// Expired entries go on the next insert, without a read of their keys: those at
    /// the front at once, those behind a longer-lived entry in the next sweep.
    #[test]
    fn expired_entries_go_without_a_read() {
        let c = ReplayCache::new(1 << 20);
        let soon = |d| Instant::now() - Duration::from_secs(60) + d;
        let short = Duration::from_millis(20);
        for i in 0..200 {
            c.put(
                &id(&format!("s{i}")),
                [1; 32],
                outcome(1),
                soon(short),
                MAX_ENTRY_LIFE,
            );
        }
        let full = c.held();
        std::thread::sleep(2 * short);
        c.put(
            &id("new"),
            [1; 32],
            outcome(1),
            Instant::now(),
            MAX_ENTRY_LIFE,
        );
        assert_eq!(c.len(), 1);
        assert!(c.held() < full / 4, "{} of {full} still held", c.held());

        // Short-lived entries behind a long-lived one: the front stays, a sweep clears.
        for i in 0..200 {
            c.put(
                &id(&format!("t{i}")),
                [1; 32],
                outcome(1),
                soon(short),
                MAX_ENTRY_LIFE,
            );
        }
        std::thread::sleep(2 * short);
        // A sweep comes within as many inserts as the last one left entries (at most
        // the 201 there were), or `SWEEP_EVERY`.
        let fresh = 201 + SWEEP_EVERY;
        for i in 0..fresh {
            c.put(
                &id(&format!("n{i}")),
                [1; 32],
                outcome(1),
                Instant::now(),
                MAX_ENTRY_LIFE,
            );
        }
        assert_eq!(c.len(), 1 + fresh);
    }

    #[test]
    fn block_sizes_follow_malloc() {
        assert_eq!(block(0), 0);
        assert_eq!(block(1), 32);
        assert_eq!(block(24), 32);
        assert_eq!(block(25), 48);
        assert_eq!(block(120), 128);
        // Small tables: 4 buckets for 3, 8 for 7; then 7/8 of a power of two.
        assert!(table_bytes(3) < table_bytes(7));
        assert_eq!(table_bytes(14), table_bytes(13));
        assert!(table_bytes(14) >= 16 * size_of::<Slot>());
    }
}
