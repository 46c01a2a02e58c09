//! A running claim's lease, renewed in the background while the call is alive.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::idem::Idem;
use crate::store::{Fence, OperationId, StoreError};

/// A claim's lease as this process knows it: renewed in the background (when renewal is
/// on) until dropped.
pub(crate) struct Lease {
    /// `None` once a renewal found the claim gone (taken over or resolved).
    held_until: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Lease {
    /// When the claim lapses unless renewed again (the last confirmed renewal, or the
    /// claim, plus the lease), or `None` when the store said it is no longer held.
    pub(crate) fn held_until(&self) -> Option<tokio::time::Instant> {
        *self.held_until.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl Lease {
    /// Holds the claim `epoch` of `id` for `lease` from `claimed_at`, renewing it in the
    /// background (when `idem` renews leases) until dropped.
    pub(crate) fn hold(
        idem: &Idem,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
        claimed_at: tokio::time::Instant,
    ) -> Lease {
        let held_until = Arc::new(Mutex::new(Some(claimed_at + lease)));
        if !idem.renews_leases() {
            return Lease {
                held_until,
                task: None,
            };
        }
        let idem = idem.clone();
        let id = id.clone();
        let every = (lease / 3).max(Duration::from_millis(1));
        let span = tracing::Span::current();
        let held = held_until.clone();
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                loop {
                    tokio::time::sleep(every).await;
                    // The store extends the lease from its own now, which is no earlier
                    // than this moment.
                    let sent = tokio::time::Instant::now();
                    // Bounded: a renewal stuck on a half-open connection must not keep
                    // this loop from trying again before the lease runs out.
                    let renewed =
                        tokio::time::timeout(every, idem.store().renew(&id, epoch, lease))
                            .await
                            .unwrap_or_else(|_| {
                                Err(StoreError::unreachable(
                                    "the lease renewal did not answer in time",
                                ))
                            });
                    match renewed {
                        Ok(Fence::Held) => {
                            *held.lock().unwrap_or_else(|p| p.into_inner()) = Some(sent + lease);
                        }
                        Ok(Fence::Lost) => {
                            tracing::debug!(epoch, "lease renewal found the claim no longer held");
                            *held.lock().unwrap_or_else(|p| p.into_inner()) = None;
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(epoch, error = %e, "lease renewal failed; retrying")
                        }
                    }
                }
            },
            span,
        ));
        Lease {
            held_until,
            task: Some(task),
        }
    }
}
