//! An operation's identity as a call holds it: shared once the call runs, and its
//! room kept on the thread for the next operation.

use std::sync::Arc;

use crate::store::OperationId;

/// An operation's identity, shared once the call runs. When the operation ends with it
/// unshared, its strings are cleared and it is kept on this thread for the next
/// operation, which fills them in the room they kept: an identity costs four
/// allocations (the `Arc` and three strings) only on a thread's first calls.
pub(crate) struct Id(Option<Arc<OperationId>>);

thread_local! {
    pub(super) static SPARE_IDS: std::cell::RefCell<Vec<Arc<OperationId>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Spare identities a thread keeps; enough for the calls one task starts at once.
const SPARE_IDS_KEPT: usize = 16;
/// An identity whose strings hold more room than this is freed rather than kept.
const SPARE_ID_ROOM: usize = 1024;

impl Id {
    /// A spare identity of this thread's, or a new one; its strings empty.
    pub(super) fn spare() -> Id {
        let spare = SPARE_IDS
            .try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop()))
            .ok()
            .flatten();
        Id(Some(spare.unwrap_or_default()))
    }

    fn arc(&self) -> &Arc<OperationId> {
        self.0
            .as_ref()
            .expect("an identity is taken only when dropped")
    }

    /// The shared identity, borrowed.
    pub(crate) fn arc_ref(&self) -> &Arc<OperationId> {
        self.arc()
    }

    /// The identity shared, for the body's context and the lease.
    pub(crate) fn shared(&self) -> Arc<OperationId> {
        self.arc().clone()
    }

    /// Written only while the builder runs, when it is not shared: no copy is made.
    pub(super) fn get_mut(&mut self) -> &mut OperationId {
        Arc::make_mut(
            self.0
                .as_mut()
                .expect("an identity is taken only when dropped"),
        )
    }
}

impl std::ops::Deref for Id {
    type Target = OperationId;
    fn deref(&self) -> &OperationId {
        self.arc()
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        let Some(mut arc) = self.0.take() else {
            return;
        };
        // Still held by a body's context or a renewal: it is theirs to free.
        let Some(id) = Arc::get_mut(&mut arc) else {
            return;
        };
        if id.scope.capacity() + id.name.capacity() + id.key.capacity() > SPARE_ID_ROOM {
            return;
        }
        id.scope.clear();
        id.name.clear();
        id.key.clear();
        // Not while the thread's storage is being torn down, nor from within a borrow.
        let _ = SPARE_IDS.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && s.len() < SPARE_IDS_KEPT
            {
                s.push(arc);
            }
        });
    }
}
