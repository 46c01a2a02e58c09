//! Outcomes this process recorded, kept briefly so a retry that comes back to the same
//! process replays without a round trip to the store.
//!
//! Safe across processes: a COMPLETED record never changes until it expires (resolve
//! settles only IN_PROGRESS and UNKNOWN records, purge removes only expired ones), and an
//! entry is dropped before its record can expire: it lives at most `retain` from the
//! moment just before the record was sent, and at most [`MAX_ENTRY_LIFE`] so that a
//! paused clock or a suspended host cannot stretch it far.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::{OperationId, StoredOutcome};

/// Longest time an entry is trusted, whatever the retention.
const MAX_ENTRY_LIFE: Duration = Duration::from_secs(60);

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

#[derive(Default)]
struct Inner {
    entries: HashMap<OperationId, Entry>,
    /// Insertion order, for eviction past the byte budget.
    order: VecDeque<OperationId>,
    bytes: usize,
}

/// A byte-bounded map of recently recorded outcomes, evicted oldest first.
pub(crate) struct ReplayCache {
    budget: usize,
    inner: Mutex<Inner>,
}

impl ReplayCache {
    /// A cache holding at most `budget` bytes of outcomes; 0 turns it off.
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
        let mut inner = self.lock();
        let entry = inner.entries.get(id)?;
        if entry.expires <= Instant::now() {
            let len = entry.outcome.body.len();
            inner.entries.remove(id);
            inner.bytes -= len;
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
        let len = outcome.body.len();
        if len > self.budget {
            return;
        }
        let expires = sent_at + retain.min(MAX_ENTRY_LIFE);
        let mut inner = self.lock();
        let Inner {
            entries,
            order,
            bytes,
        } = &mut *inner;
        if let Some(old) = entries.insert(
            id.clone(),
            Entry {
                fingerprint,
                outcome: Arc::new(outcome),
                expires,
            },
        ) {
            *bytes -= old.outcome.body.len();
        } else {
            order.push_back(id.clone());
        }
        *bytes += len;
        while *bytes > self.budget {
            let Some(oldest) = order.pop_front() else {
                break;
            };
            if let Some(e) = entries.remove(&oldest) {
                *bytes -= e.outcome.body.len();
            }
        }
        // Ids whose entries expired and were removed by `get` linger in `order`; drop
        // them when they outnumber the live entries, so the queue stays bounded.
        if order.len() > 2 * entries.len() + 64 {
            order.retain(|k| entries.contains_key(k));
        }
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
            body: vec![b'x'; n],
        }
    }

    #[test]
    fn replays_mismatches_expires_and_evicts() {
        let c = ReplayCache::new(100);
        let now = Instant::now();
        c.put(&id("a"), [1; 32], outcome(40), now, Duration::from_secs(10));
        assert!(matches!(c.get(&id("a"), &[1; 32]), Some(Cached::Replay(_))));
        assert!(matches!(c.get(&id("a"), &[2; 32]), Some(Cached::Mismatch)));
        // Already expired when put: never served.
        c.put(
            &id("b"),
            [1; 32],
            outcome(10),
            now - Duration::from_secs(20),
            Duration::from_secs(10),
        );
        assert!(c.get(&id("b"), &[1; 32]).is_none());
        // Over budget: the oldest goes.
        c.put(&id("c"), [1; 32], outcome(40), now, Duration::from_secs(10));
        c.put(&id("d"), [1; 32], outcome(40), now, Duration::from_secs(10));
        assert!(c.get(&id("a"), &[1; 32]).is_none());
        assert!(c.get(&id("d"), &[1; 32]).is_some());
        assert!(ReplayCache::new(0).get(&id("d"), &[1; 32]).is_none());
    }
}
