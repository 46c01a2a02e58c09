//! In-process wake-ups for callers waiting on an in-flight operation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::store::OperationId;

/// The callers of one process waiting on in-flight operations, by operation.
///
/// The runtime wakes them when this process records or releases an operation; a store
/// that hears of changes made by other processes (PostgreSQL's `LISTEN`) wakes them
/// through [`WakeHub::wake`]. A woken waiter re-issues the claim, so a spurious wake
/// costs one statement and a missed one costs one poll interval.
#[derive(Debug, Default)]
pub struct WakeHub {
    waiting: Mutex<HashMap<OperationId, (Arc<Notify>, usize)>>,
}

impl WakeHub {
    /// Wakes every caller of this process waiting on `id`.
    pub fn wake(&self, id: &OperationId) {
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((notify, _)) = waiting.get(id) {
            notify.notify_waiters();
        }
    }

    /// Whether any caller of this process waits on `id`.
    pub fn is_waited(&self, id: &OperationId) -> bool {
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        waiting.contains_key(id)
    }

    /// Registers a waiter, unless `max` already wait on `id`.
    pub(crate) fn register(self: &Arc<Self>, id: &OperationId, max: usize) -> Option<Waiter> {
        // With no waiter allowed there is nothing to register, and an entry made here
        // would never be removed: only a dropped `Waiter` removes one.
        if max == 0 {
            return None;
        }
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let entry = waiting
            .entry(id.clone())
            .or_insert_with(|| (Arc::new(Notify::new()), 0));
        if entry.1 >= max {
            return None;
        }
        entry.1 += 1;
        Some(Waiter {
            hub: self.clone(),
            id: id.clone(),
            notify: entry.0.clone(),
        })
    }
}

/// One registered waiter; deregisters on drop.
pub(crate) struct Waiter {
    hub: Arc<WakeHub>,
    id: OperationId,
    pub(crate) notify: Arc<Notify>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut waiting = self.hub.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = waiting.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                waiting.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> OperationId {
        OperationId {
            scope: String::new(),
            name: "op".into(),
            key: key.into(),
        }
    }

    fn entries(hub: &WakeHub) -> usize {
        hub.waiting.lock().unwrap().len()
    }

    #[test]
    fn no_entry_is_kept_when_no_waiter_may_register() {
        let hub = Arc::new(WakeHub::default());
        for k in ["a", "b", "c"] {
            assert!(hub.register(&id(k), 0).is_none());
        }
        assert_eq!(entries(&hub), 0);
        assert!(!hub.is_waited(&id("a")));
    }

    #[test]
    fn a_refused_waiter_leaves_the_entry_of_the_admitted_ones() {
        let hub = Arc::new(WakeHub::default());
        let first = hub
            .register(&id("a"), 1)
            .expect("the first waiter is admitted");
        assert!(hub.register(&id("a"), 1).is_none());
        assert_eq!(entries(&hub), 1);
        drop(first);
        assert_eq!(entries(&hub), 0);
    }
}
