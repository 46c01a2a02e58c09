//! Outcomes this process recorded, kept briefly so a retry that comes back to the same
//! process replays without a round trip to the store.
//!
//! Safe across processes: a COMPLETED record never changes until it expires (resolve
//! settles only IN_PROGRESS and UNKNOWN records, purge removes only expired ones), and an
//! entry is dropped before its record can expire: it lives at most `retain` from the
//! moment just before the claim was sent, and at most [`MAX_ENTRY_LIFE`] so that a
//! paused clock or a suspended host cannot stretch it far.
//!
//! # Its cost on a call
//!
//! Every call reads the cache and every call that records fills it, so both stay
//! short: one hash of the identity per read or fill (foldhash, seeded per cache), one
//! allocation per entry (the identity, packed), the outcome kept as the shared body the
//! store was sent, and an eviction that pops the oldest entry and finds its number in
//! the index by the hash it kept, reading no identity. One mutex guards it: a critical
//! section is a few probes.
//!
//! # What the budget counts
//!
//! Everything the cache holds on the heap: per entry, its packed identity and the
//! outcome's body; and the ring of entries and the index at their capacity. Each
//! heap block is counted as glibc's `malloc` sizes it on 64-bit platforms (the request
//! plus an 8-byte header, rounded up to 16, at least 32: [`block`]), so what the cache
//! holds stays within its budget; an allocator with coarser size classes can take a few
//! bytes more per block. The index's size follows hashbrown's layout
//! (`tests/bounds_load.rs` measures it all with a counting allocator).
//!
//! # When entries go
//!
//! Oldest first, when an insert would take the cache past its budget; and once expired,
//! on the next insert: entries leave the ring's front while they are expired, and when
//! retentions differ (an entry expiring before one inserted earlier), a sweep of the
//! whole cache, at most once per as many inserts as the last sweep left entries, drops
//! the rest. A read of an expired entry answers nothing and leaves it for those. Reads
//! allocate nothing.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::mem::size_of;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hashbrown::HashTable;

use crate::store::packed::Packed;
use crate::store::{OperationId, StoredOutcome};

/// Longest time an entry is trusted, whatever the retention.
const MAX_ENTRY_LIFE: Duration = Duration::from_secs(60);

/// Fewest inserts between two sweeps of the whole cache.
const SWEEP_EVERY: usize = 64;

struct Entry {
    fingerprint: [u8; 32],
    outcome: StoredOutcome,
    expires: Instant,
}

/// What the cache knows of an operation.
pub(crate) enum Cached {
    /// Completed with this outcome (its body shared with the cache), for this
    /// fingerprint.
    Replay(StoredOutcome),
    /// Completed for another fingerprint.
    Mismatch,
}

/// An entry as the ring holds it, with its identity and that identity's hash.
struct Slot {
    hash: u64,
    id: Packed,
    entry: Entry,
}

/// The entries in the order they were inserted, each numbered by its insert (its
/// sequence number), and an index from an identity's hash to those numbers.
///
/// The ring is the eviction queue itself: the oldest entry is at its front. The index
/// holds 8 bytes an entry, so whatever it keeps of removed slots (hashbrown leaves
/// markers, and doubles a table those and its entries fill) costs little; the ring never
/// grows past what the budget holds, as the oldest entry can always make room.
#[derive(Default)]
struct Inner {
    index: HashTable<u64>,
    /// `None` where an entry was removed before its turn (forgotten, or expired behind
    /// a longer-lived one); the front is always `Some`.
    ring: VecDeque<Option<Slot>>,
    /// The sequence number of the ring's front.
    first: u64,
    /// What the entries hold on the heap, the index and the ring aside.
    bytes: usize,
    /// The index's capacity when it last grew or was rebuilt: its allocation.
    /// (`HashTable::capacity` drops below it while removed slots await reuse.)
    index_capacity: usize,
    /// The latest expiry inserted.
    latest: Option<Instant>,
    /// An entry expires before one inserted earlier, so popping the ring's expired
    /// front may leave it behind.
    disordered: bool,
    /// Inserts since the last sweep.
    since_sweep: usize,
    /// Entries left by the last sweep: the next waits for as many inserts, so sweeps
    /// cost O(1) per insert (the entries can at most have doubled since).
    swept_len: usize,
}

/// A byte-bounded map of recently recorded outcomes, evicted oldest first.
///
/// One lock, not shards: a critical section is a few probes, and a call's round trip to
/// the store, not this lock, is what calls wait on; shards would spread the entries
/// over more memory, and each eviction reads memory gone cold.
pub(crate) struct ReplayCache {
    budget: usize,
    /// Seeded per cache, so identities an attacker chooses cannot be steered into one
    /// bucket; foldhash rather than SipHash, which would cost a read a tenth of a call
    /// on a store in this process.
    hasher: foldhash::quality::RandomState,
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

/// The heap of an outcome's body (an `Arc<[u8]>`: two counts and the bytes).
fn body_bytes(outcome: &StoredOutcome) -> usize {
    block(2 * size_of::<usize>() + outcome.body.len())
}

/// The heap an entry holds: its packed identity and its outcome's body.
fn entry_bytes(id: &Packed, outcome: &StoredOutcome) -> usize {
    block(id.text_len()) + body_bytes(outcome)
}

/// The heap of a hashbrown table of sequence numbers of `capacity`: a power of two of
/// buckets, 7/8 of them usable (all but one below 8 buckets), each a number and a
/// control byte, and 16 trailing control bytes.
fn index_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        (capacity * 8).div_ceil(7)
    }
    .next_power_of_two();
    block((buckets * size_of::<u64>()).next_multiple_of(16) + buckets + 16)
}

/// The heap of a ring of `capacity` slots.
fn ring_bytes(capacity: usize) -> usize {
    block(capacity * size_of::<Option<Slot>>())
}

impl Inner {
    /// Everything the cache holds on the heap, as the budget counts it.
    fn held(&self) -> usize {
        self.bytes + index_bytes(self.index_capacity) + ring_bytes(self.ring.capacity())
    }

    /// The entry numbered `seq`, if it is still held.
    fn slot(ring: &VecDeque<Option<Slot>>, first: u64, seq: u64) -> Option<&Slot> {
        let at = usize::try_from(seq.checked_sub(first)?).ok()?;
        ring.get(at)?.as_ref()
    }

    /// The number of `id`'s entry, whose hash is `hash`.
    fn find(&self, hash: u64, id: &OperationId) -> Option<u64> {
        let (ring, first) = (&self.ring, self.first);
        let is = |&seq: &u64| {
            Self::slot(ring, first, seq).is_some_and(|s| s.hash == hash && s.id.is(id))
        };
        self.index.find(hash, is).copied()
    }

    /// Takes `seq` (whose entry's hash is `hash`) out of the index.
    fn unindex(&mut self, hash: u64, seq: u64) {
        if let Ok(found) = self.index.find_entry(hash, |&q| q == seq) {
            found.remove();
        }
    }

    /// Drops the entry numbered `seq` where it stands, leaving a gap in the ring.
    fn remove(&mut self, seq: u64) {
        if let Some(at) = seq
            .checked_sub(self.first)
            .and_then(|a| usize::try_from(a).ok())
        {
            self.take(at);
        }
        self.close_front();
    }

    /// Drops the entry at ring position `at`, leaving a gap; positions stay as they are
    /// until [`close_front`](Self::close_front).
    fn take(&mut self, at: usize) {
        if let Some(slot) = self.ring.get_mut(at).and_then(Option::take) {
            self.unindex(slot.hash, self.first + at as u64);
            self.bytes -= entry_bytes(&slot.id, &slot.entry.outcome);
        }
    }

    /// Pops the gaps at the ring's front, so the front is an entry.
    fn close_front(&mut self) {
        while let Some(None) = self.ring.front() {
            self.ring.pop_front();
            self.first += 1;
        }
    }

    /// Drops the oldest entry; `false` when there is none.
    fn evict_oldest(&mut self) -> bool {
        let Some(slot) = self.ring.pop_front().flatten() else {
            return false;
        };
        self.unindex(slot.hash, self.first);
        self.first += 1;
        self.bytes -= entry_bytes(&slot.id, &slot.entry.outcome);
        self.close_front();
        true
    }

    /// Drops expired entries: those at the ring's front, and all of them in a sweep
    /// when the ring is out of expiry order and enough inserts came since the last.
    fn drop_expired(&mut self, now: Instant) {
        while let Some(Some(front)) = self.ring.front() {
            if front.entry.expires > now {
                break;
            }
            self.evict_oldest();
        }
        self.since_sweep += 1;
        if self.disordered && self.since_sweep >= self.swept_len.max(SWEEP_EVERY) {
            for at in 0..self.ring.len() {
                if self.ring[at]
                    .as_ref()
                    .is_some_and(|s| s.entry.expires <= now)
                {
                    self.take(at);
                }
            }
            self.close_front();
            self.disordered = false;
            self.since_sweep = 0;
            self.swept_len = self.index.len();
        }
        // A ring and an index left mostly empty by expiries are rebuilt smaller; they
        // double again only after the entries do, so the rebuilds cost O(1) per insert.
        let len = self.index.len();
        if self.ring.capacity() > 4 * len.max(SWEEP_EVERY / 4) {
            self.ring.shrink_to(2 * len);
            let (ring, first) = (&self.ring, self.first);
            let rehash = |&seq: &u64| Self::slot(ring, first, seq).map_or(0, |s| s.hash);
            self.index.shrink_to(2 * len, rehash);
            self.index_capacity = self.index.capacity();
        }
    }

    /// Adds or replaces the entry of `id`, whose hash is `hash`, within `budget`.
    fn insert(&mut self, hash: u64, id: &OperationId, entry: Entry, budget: usize) {
        if entry.expires < *self.latest.get_or_insert(entry.expires) {
            self.disordered = true;
        }
        self.latest = self.latest.max(Some(entry.expires));
        if let Some(seq) = self.find(hash, id) {
            // The identity stays, and so does its place in the ring.
            let at = (seq - self.first) as usize;
            if let Some(old) = self.ring[at].as_mut() {
                self.bytes += body_bytes(&entry.outcome);
                self.bytes -= body_bytes(&old.entry.outcome);
                old.entry = entry;
            }
            return;
        }
        // A full ring doubles on the next push; where the doubled ring would not fit
        // the budget, the oldest entry makes room instead.
        let size = self.ring.capacity();
        if self.ring.len() == size
            && self.held() + ring_bytes((2 * size).max(4)) - ring_bytes(size) > budget
        {
            self.evict_oldest();
        }
        let id = Packed::new(id);
        self.bytes += entry_bytes(&id, &entry.outcome);
        let seq = self.first + self.ring.len() as u64;
        self.ring.push_back(Some(Slot { hash, id, entry }));
        let (ring, first) = (&self.ring, self.first);
        let rehash = |&q: &u64| Self::slot(ring, first, q).map_or(0, |s| s.hash);
        self.index.insert_unique(hash, seq, rehash);
        self.index_capacity = self.index_capacity.max(self.index.capacity());
    }
}

impl ReplayCache {
    /// A cache holding at most `budget` bytes of memory; 0 turns it off.
    pub(crate) fn new(budget: usize) -> Self {
        ReplayCache {
            budget,
            hasher: foldhash::quality::RandomState::default(),
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hash(&self, id: &OperationId) -> u64 {
        self.hasher.hash_one([&id.scope, &id.name, &id.key])
    }

    pub(crate) fn get(&self, id: &OperationId, fingerprint: &[u8; 32]) -> Option<Cached> {
        if self.budget == 0 {
            return None;
        }
        let hash = self.hash(id);
        let inner = self.lock();
        let seq = inner.find(hash, id)?;
        let entry = &Inner::slot(&inner.ring, inner.first, seq)?.entry;
        if entry.expires <= Instant::now() {
            return None;
        }
        Some(if &entry.fingerprint == fingerprint {
            Cached::Replay(entry.outcome.clone())
        } else {
            Cached::Mismatch
        })
    }

    /// Remembers an outcome kept for `retain` from `from` (no later than the claim's
    /// send).
    pub(crate) fn put(
        &self,
        id: &OperationId,
        fingerprint: [u8; 32],
        outcome: StoredOutcome,
        from: Instant,
        retain: Duration,
    ) {
        if self.budget == 0 {
            return;
        }
        let now = Instant::now();
        let expires = from + retain.min(MAX_ENTRY_LIFE);
        if expires <= now {
            return;
        }
        let alone = block(id.scope.len() + id.name.len() + id.key.len()) + body_bytes(&outcome);
        if alone > self.budget {
            return;
        }
        let hash = self.hash(id);
        let mut inner = self.lock();
        inner.drop_expired(now);
        inner.insert(
            hash,
            id,
            Entry {
                fingerprint,
                outcome,
                expires,
            },
            self.budget,
        );
        while inner.held() > self.budget && inner.evict_oldest() {}
    }

    /// Drops `id`'s entry: an operator forgot the record, so it must not be replayed
    /// from here.
    pub(crate) fn forget(&self, id: &OperationId) {
        if self.budget == 0 {
            return;
        }
        let hash = self.hash(id);
        let mut inner = self.lock();
        if let Some(seq) = inner.find(hash, id) {
            inner.remove(seq);
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
        let held = inner.ring.iter().filter(|s| s.is_some()).count();
        assert_eq!(inner.index.len(), held);
        held
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
        entry_bytes(&Packed::new(&id(k)), &outcome(n))
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
        for budget in [64 * 1024, 96 * 1024, 150 * 1024, 256 * 1024] {
            fill_within(budget);
        }
    }

    /// Puts 20 times as many entries as `budget` holds, checking it all along.
    fn fill_within(budget: usize) {
        let c = ReplayCache::new(budget);
        let now = Instant::now();
        let key = |i: usize| format!("{i:0>120}");
        // An entry's own cost: its heap, its slot in the ring and its number in the index.
        let per_entry = cost(&key(0), 1) + size_of::<Option<Slot>>() + size_of::<u64>();
        let most = budget / per_entry;
        let mut fewest = usize::MAX;
        for i in 0..20 * most {
            c.put(
                &id(&key(i)),
                [1; 32],
                outcome(1),
                now,
                Duration::from_secs(60),
            );
            assert!(c.held() <= budget, "{} > {budget} after {i}", c.held());
            if i >= 2 * most {
                fewest = fewest.min(c.len());
            }
        }
        let kept = c.len();
        assert!(
            kept <= most,
            "{kept} entries of {per_entry} bytes each in {budget} bytes"
        );
        // Full all along, not merely small: while entries keep coming, the ring and the
        // index must not grow past what the budget holds and crowd the entries out.
        assert!(
            fewest >= 3 * most / 4,
            "only {fewest} entries of {most} kept at one point in {budget} bytes"
        );
        assert!(c.get(&id(&key(20 * most - 1)), &[1; 32]).is_some());
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
        assert!(index_bytes(3) < index_bytes(7));
        assert_eq!(index_bytes(14), index_bytes(13));
        assert!(index_bytes(14) >= 16 * size_of::<u64>());
    }
}
