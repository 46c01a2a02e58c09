//! Running claims' leases, renewed in the background while their calls are alive.
//!
//! One task per [`Idem`](crate::Idem) renews every live claim from a schedule ordered by due time, so
//! a call pays for a map entry rather than a spawned task. A call on another runtime than
//! the one that task runs on gets a renewal task of its own, so its renewals never wait
//! on a runtime that is not being driven. A claim is filed for renewal when its body
//! first waits: a body that ends on its first poll costs no entry.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::store::{Fence, OperationId, Store, StoreError};

/// When the claim lapses unless renewed again; `None` once a renewal found it gone.
pub(crate) type Held = Arc<Mutex<Option<Instant>>>;

/// Whether a renewal found the claim behind `held` gone (taken over, resolved).
pub(crate) fn known_lost(held: &Held) -> bool {
    lock(held).is_none()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A claim's lease as this process knows it: renewed in the background (when renewal is
/// on) from the moment its body first waits, until dropped.
pub(crate) struct Lease<'a> {
    held_until: Held,
    renewal: Renewal<'a>,
}

pub(crate) enum Renewal<'a> {
    None,
    /// To be filed with the renewer when the body first waits: a body that ends on its
    /// first poll never needed a renewal, and costs no entry in the schedule.
    Due(Due<'a>),
    /// An entry in the `Idem`'s schedule.
    Shared(Arc<Renewer>, u64),
    /// A task of this call's own, on its own runtime.
    Own(JoinHandle<()>),
}

/// What filing a claim for renewal takes, borrowed from the call until it is filed.
pub(crate) struct Due<'a> {
    renewer: &'a Arc<Renewer>,
    store: &'a Arc<dyn Store>,
    id: &'a Arc<OperationId>,
    epoch: u64,
    lease: Duration,
    store_timeout: Duration,
    claimed_at: Instant,
}

impl<'a> Lease<'a> {
    /// When the claim lapses unless renewed again (the last confirmed renewal, or the
    /// claim, plus the lease), or `None` when the store said it is no longer held.
    pub(crate) fn held_until(&self) -> Option<Instant> {
        *lock(&self.held_until)
    }

    /// What the renewals learn of the claim, for a body to check: `None` where nothing
    /// renews it (renewal off), so nothing can learn it was lost.
    pub(crate) fn watch(&self) -> Option<Held> {
        match self.renewal {
            Renewal::None => None,
            _ => Some(self.held_until.clone()),
        }
    }

    /// Holds the claim `epoch` of `id` for `lease` from `claimed_at`, to be renewed in
    /// the background through `renewer` (when there is one: renewal is on) once
    /// [`renewed_while`](Self::renewed_while) finds the body waiting, until dropped. A
    /// renewal waits at most `store_timeout` (and a third of the lease) for its answer.
    pub(crate) fn hold(
        renewer: Option<&'a Arc<Renewer>>,
        store: &'a Arc<dyn Store>,
        id: &'a Arc<OperationId>,
        epoch: u64,
        lease: Duration,
        store_timeout: Duration,
        claimed_at: Instant,
    ) -> Lease<'a> {
        let renewal = match renewer {
            Some(renewer) => Renewal::Due(Due {
                renewer,
                store,
                id,
                epoch,
                lease,
                store_timeout,
                claimed_at,
            }),
            None => Renewal::None,
        };
        Lease {
            held_until: Arc::new(Mutex::new(Some(claimed_at + lease))),
            renewal,
        }
    }

    /// Runs `body`, filing the claim for renewal the first time it waits. The body is
    /// polled where it is pinned, not moved into this future.
    pub(crate) async fn renewed_while<F: std::future::Future>(
        &mut self,
        mut body: std::pin::Pin<&mut F>,
    ) -> F::Output {
        std::future::poll_fn(|cx| {
            let out = body.as_mut().poll(cx);
            if out.is_pending() {
                self.file();
            }
            out
        })
        .await
    }

    /// Files a claim still due for renewal with the renewer.
    fn file(&mut self) {
        let Renewal::Due(due) = &self.renewal else {
            return;
        };
        let claim = Claim {
            id: due.id.clone(),
            epoch: due.epoch,
            lease: due.lease,
            store_timeout: due.store_timeout,
            held: self.held_until.clone(),
            span: tracing::Span::current(),
        };
        let store = due.store;
        self.renewal = due.renewer.add(|| store.clone(), claim, due.claimed_at);
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        match &self.renewal {
            Renewal::None | Renewal::Due(_) => {}
            Renewal::Shared(renewer, slot) => renewer.remove(*slot),
            Renewal::Own(task) => task.abort(),
        }
    }
}

/// What a renewal needs of one claim.
#[derive(Clone)]
struct Claim {
    id: Arc<OperationId>,
    epoch: u64,
    lease: Duration,
    store_timeout: Duration,
    held: Held,
    /// The call's span, so renewal logs carry its scope, name and key.
    span: tracing::Span,
}

impl Claim {
    /// How often the claim is renewed: three times a lease.
    fn every(&self) -> Duration {
        (self.lease / 3).max(Duration::from_millis(1))
    }

    /// Renews once. `false` when the store says the claim is gone, so renewals stop.
    async fn renew(&self, store: &dyn Store) -> bool {
        tracing::Instrument::instrument(self.renew_in_span(store), self.span.clone()).await
    }

    async fn renew_in_span(&self, store: &dyn Store) -> bool {
        // The store extends the lease from its own now, which is no earlier than this.
        let sent = Instant::now();
        // Bounded: a renewal stuck on a half-open connection must not keep the next one
        // from being tried before the lease runs out, nor hold that connection past the
        // store timeout (dropped, its statement's connection is closed).
        let bound = self.every().min(self.store_timeout);
        let renewed = tokio::time::timeout(bound, store.renew(&self.id, self.epoch, self.lease))
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::unreachable(
                    "the lease renewal did not answer in time",
                ))
            });
        match renewed {
            Ok(Fence::Held) => {
                *lock(&self.held) = Some(sent + self.lease);
                true
            }
            Ok(Fence::Lost) => {
                tracing::debug!(
                    epoch = self.epoch,
                    "lease renewal found the claim no longer held"
                );
                *lock(&self.held) = None;
                false
            }
            Err(e) => {
                tracing::warn!(epoch = self.epoch, error = %e, "lease renewal failed; retrying");
                true
            }
        }
    }
}

/// The schedule of one `Idem`'s live claims and the task that renews them.
#[derive(Default)]
pub(crate) struct Renewer {
    state: Mutex<Schedule>,
    /// Wakes the task for an earlier due time, or to end once the `Idem` is gone.
    wake: Arc<Notify>,
}

#[derive(Default)]
struct Schedule {
    next_slot: u64,
    /// Live claims by slot, each with the due time it is filed under in `due` (none
    /// while its renewal is in flight).
    claims: HashMap<u64, (Claim, Option<Instant>), foldhash::fast::RandomState>,
    /// Due times; an entry whose slot is gone or refiled is skipped.
    due: BTreeSet<(Instant, u64)>,
    /// When the task's sleep ends, as it last filed it; `None` while it runs or waits
    /// for a wake alone. A claim due no earlier needs no wake: the task looks at the
    /// schedule again by then. Without it every call with no other claim live woke the
    /// task, which set up its timer anew.
    task_wakes_at: Option<Instant>,
    /// The renewal task and the runtime it runs on.
    task: Option<(tokio::runtime::Id, JoinHandle<()>)>,
}

impl Drop for Renewer {
    fn drop(&mut self) {
        // The task holds only a weak reference: woken, it finds the schedule gone and ends.
        self.wake.notify_one();
    }
}

impl Renewer {
    /// Files `claim` for renewal from `from`. `store` is called only where a task
    /// starts: a call pays no reference count for it.
    fn add(
        self: &Arc<Self>,
        store: impl Fn() -> Arc<dyn Store>,
        claim: Claim,
        from: Instant,
    ) -> Renewal<'static> {
        let Ok(runtime) = Handle::try_current() else {
            // Leases are held inside a call, which runs on a runtime; without one there is
            // nothing to renew on.
            return Renewal::None;
        };
        let mut st = lock(&self.state);
        let task_here = match &st.task {
            Some((rt, task)) if !task.is_finished() => *rt == runtime.id(),
            // None running (or its runtime shut down): start one on this runtime.
            _ => {
                let me = Arc::downgrade(self);
                let task = runtime.spawn(run(me, self.wake.clone(), store()));
                st.task = Some((runtime.id(), task));
                st.task_wakes_at = None;
                true
            }
        };
        if !task_here {
            drop(st);
            let store = store();
            return Renewal::Own(runtime.spawn(async move {
                loop {
                    tokio::time::sleep(claim.every()).await;
                    if !claim.renew(&*store).await {
                        return;
                    }
                }
            }));
        }
        let slot = st.next_slot;
        st.next_slot += 1;
        st.claims.insert(slot, (claim, None));
        self.file_locked(st, slot, from);
        Renewal::Shared(self.clone(), slot)
    }

    /// Forgets `slot`, and its due time, so the schedule holds live claims only.
    fn remove(&self, slot: u64) {
        let mut st = lock(&self.state);
        if let Some((_, Some(due))) = st.claims.remove(&slot) {
            st.due.remove(&(due, slot));
        }
    }

    /// Files `slot` for its next renewal, `every` after `from` (its claim, or the end of
    /// its last renewal), waking the task when it would otherwise sleep past it.
    fn file(&self, slot: u64, from: Instant) {
        self.file_locked(lock(&self.state), slot, from);
    }

    /// [`file`](Self::file), under the lock `st` already holds; the wake is sent after
    /// it is released.
    fn file_locked(&self, mut st: MutexGuard<'_, Schedule>, slot: u64, from: Instant) {
        let wake = st.file(slot, from);
        drop(st);
        if wake {
            self.wake.notify_one();
        }
    }
}

impl Schedule {
    /// Files `slot` `every` after `from`; whether the task must be woken to renew it in
    /// time. A new claim is filed from the instant it was claimed, which the caller read
    /// already.
    fn file(&mut self, slot: u64, from: Instant) -> bool {
        let Some((claim, due)) = self.claims.get_mut(&slot) else {
            return false;
        };
        let t = from + claim.every();
        *due = Some(t);
        self.due.insert((t, slot));
        self.task_wakes_at.is_none_or(|wakes| t < wakes)
    }
}

/// The renewal task: sleeps until the earliest due claim, starts the renewals due, and
/// ends when its `Idem` is gone.
async fn run(me: Weak<Renewer>, wake: Arc<Notify>, store: Arc<dyn Store>) {
    loop {
        let next = {
            let Some(renewer) = me.upgrade() else {
                return;
            };
            let now = Instant::now();
            let mut st = lock(&renewer.state);
            while let Some(&(t, slot)) = st.due.first() {
                if t > now {
                    break;
                }
                st.due.pop_first();
                let Some((claim, due)) = st.claims.get_mut(&slot) else {
                    continue;
                };
                if *due != Some(t) {
                    continue;
                }
                *due = None;
                let (claim, store, me) = (claim.clone(), store.clone(), me.clone());
                // Each renewal in a task of its own, so a slow store delays no other claim.
                tokio::spawn(async move {
                    let alive = claim.renew(&*store).await;
                    if let Some(renewer) = me.upgrade() {
                        if alive {
                            renewer.file(slot, Instant::now());
                        } else {
                            renewer.remove(slot);
                        }
                    }
                });
            }
            let next = st.due.first().map(|&(t, _)| t);
            st.task_wakes_at = next;
            next
        };
        // A wake sent while the schedule was read is kept as a permit, so none is lost.
        match next {
            Some(t) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(t) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(lease: Duration) -> Claim {
        Claim {
            id: Arc::new(OperationId {
                scope: String::new(),
                name: "op".into(),
                key: "k".into(),
            }),
            epoch: 1,
            lease,
            store_timeout: Duration::from_secs(5),
            held: Arc::default(),
            span: tracing::Span::none(),
        }
    }

    /// The task is woken only for a claim due before it would wake anyway: a call whose
    /// claim is due later costs no wake (and no new timer in the task).
    #[test]
    fn a_claim_due_after_the_task_wakes_sends_no_wake() {
        let now = Instant::now();
        let mut st = Schedule::default();
        for (slot, lease) in [(1, 60), (2, 600), (3, 3)] {
            st.claims
                .insert(slot, (claim(Duration::from_secs(lease)), None));
        }
        // Waiting for a wake alone: any claim needs one.
        assert!(st.file(1, now));
        // Asleep until the first claim's renewal, 20 s away.
        st.task_wakes_at = Some(now + Duration::from_secs(20));
        assert!(!st.file(2, now), "due in 200 s, after the task wakes");
        assert!(st.file(3, now), "due in 1 s, before the task wakes");
    }
}
