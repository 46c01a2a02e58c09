//! The `Idem` handle and its builder.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::cache::ReplayCache;
use crate::error::IdemError;
use crate::store::wake::{Waiter, WakeHub};
use crate::store::{
    ListFilter, MemoryStore, OperationId, RecordInfo, Resolution, Stats, Store, StoredOutcome,
};

static GLOBAL: RwLock<Option<Idem>> = RwLock::new(None);

/// A cheap, cloneable handle on an idempotency store.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::IdemError> {
/// use idem_runtime::Idem;
/// let idem = Idem::sqlite("sqlite::memory:").await?;
/// let sent = idem
///     .operation("send_welcome", "user-7")
///     .run(|| async { Ok::<_, idem_runtime::IdemError>("sent".to_string()) })
///     .await?;
/// assert_eq!(sent, "sent");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Idem {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    /// The same store when it is the built-in memory store, unwrapped: calls claim and
    /// record on it directly, without a boxed future or a copy of the outcome.
    local: Option<Arc<MemoryStore>>,
    tx: crate::store::SqlStores,
    hub: Arc<WakeHub>,
    cache: ReplayCache,
    cfg: Config,
    /// Renews this handle's live claims.
    renewer: Arc<crate::lease::Renewer>,
}

/// What an `Idem` runs with, as its builder decided.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) max_outcome_bytes: usize,
    pub(crate) max_waiters: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) renew_leases: bool,
    pub(crate) hash_keys: Option<Secret>,
    pub(crate) log_keys_hashed: bool,
}

/// The `hash_keys` secret; never printed.
#[derive(Clone)]
pub(crate) struct Secret(pub(crate) Arc<[u8]>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::fmt::Debug for Idem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idem")
            .field("config", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl AsRef<Idem> for Idem {
    fn as_ref(&self) -> &Idem {
        self
    }
}

impl Idem {
    /// Sets the process-wide store used by `#[idempotent]` functions that name no
    /// `store`. A later call replaces it.
    pub fn set_global(idem: Idem) {
        *GLOBAL.write().unwrap_or_else(|p| p.into_inner()) = Some(idem);
    }

    /// The process-wide store, if one was set.
    pub fn global() -> Option<Idem> {
        GLOBAL.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Deletes completed records past their retention; returns how many. Records in
    /// progress or UNKNOWN are never purged.
    pub async fn purge_expired(&self) -> Result<u64, IdemError> {
        let n = self
            .store()
            .purge_expired()
            .await
            .map_err(|e| IdemError::store("purge", e))?;
        tracing::debug!(purged = n, "purge");
        crate::metrics::purged(n);
        Ok(n)
    }

    /// Purges expired records every `every` in a background task, which stops when the
    /// returned handle is dropped.
    pub fn spawn_reaper(&self, every: Duration) -> ReaperHandle {
        let idem = self.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = idem.purge_expired().await {
                    tracing::warn!(error = %e, "reaper: purge failed");
                }
            }
        });
        ReaperHandle { task }
    }

    /// Counts by state and the age of the oldest stuck records, for alerting.
    pub async fn stats(&self) -> Result<Stats, IdemError> {
        self.store()
            .stats()
            .await
            .map_err(|e| IdemError::store("stats", e))
    }

    /// Records matching `filter`, oldest first, for reconciliation.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, IdemError> {
        self.store()
            .list(filter)
            .await
            .map_err(|e| IdemError::store("list", e))
    }

    /// One record in full (state, epoch, ages, lease, outcome), or `None` when the store
    /// holds nothing for `id`. For operators; `id` as [`Idem::list`] or
    /// [`Operation::id`](crate::Operation::id) give it.
    pub async fn get(
        &self,
        id: &OperationId,
    ) -> Result<Option<crate::store::RecordDetail>, IdemError> {
        self.store()
            .get(id)
            .await
            .map_err(|e| IdemError::store("get", e))
    }

    /// Settles an UNKNOWN (or stuck IN_PROGRESS) operation at `epoch` (from
    /// [`Idem::list`] or [`IdemError::Unknown`]). Returns [`IdemError::Fenced`] when the
    /// record is no longer at that epoch.
    pub async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        resolution: Resolution,
    ) -> Result<(), IdemError> {
        let completed = match &resolution {
            Resolution::Retry => None,
            Resolution::Completed {
                outcome: value,
                version,
                retain,
            }
            | Resolution::Rejected {
                error: value,
                version,
                retain,
            } => {
                let body = serde_json::to_vec(value).map_err(|e| IdemError::Codec {
                    name: id.name.clone(),
                    message: e.to_string(),
                })?;
                // The same cap as a recorded outcome: an operator's is replayed alike.
                let max = self.inner.cfg.max_outcome_bytes;
                if body.len() > max {
                    return Err(IdemError::OutcomeTooLarge {
                        name: id.name.clone(),
                        len: body.len(),
                        max,
                    });
                }
                let stored = StoredOutcome {
                    is_err: matches!(resolution, Resolution::Rejected { .. }),
                    version: *version,
                    body,
                };
                Some((stored, *retain))
            }
        };
        let fence = self
            .store()
            .resolve(id, epoch, completed.as_ref().map(|(o, r)| (o, *r)))
            .await
            .map_err(|e| IdemError::store("resolve", e))?;
        self.wake(id);
        match fence {
            crate::store::Fence::Held => {
                tracing::info!(scope = %self.log_key(&id.scope), name = %id.name, key = %self.log_key(&id.key), epoch, ?resolution, "resolved");
                Ok(())
            }
            crate::store::Fence::Lost => Err(IdemError::Fenced {
                name: id.name.clone(),
                epoch,
            }),
        }
    }

    pub(crate) fn new(
        store: Arc<dyn Store>,
        local: Option<Arc<MemoryStore>>,
        tx: crate::store::SqlStores,
        cfg: Config,
        replay_cache_bytes: usize,
    ) -> Idem {
        let hub = Arc::new(WakeHub::default());
        store.attach_wakers(hub.clone());
        Idem {
            inner: Arc::new(Inner {
                store,
                local,
                tx,
                hub,
                cache: ReplayCache::new(replay_cache_bytes),
                cfg,
                renewer: Arc::default(),
            }),
        }
    }

    pub(crate) fn renews_leases(&self) -> bool {
        self.inner.cfg.renew_leases
    }

    /// Whether claims in the local memory store are pinned rather than renewed (see
    /// `MemoryStore::claim_now`): the claim and the lease that unpins it must agree.
    pub(crate) fn pins_claims(&self) -> bool {
        self.renews_leases()
    }

    pub(crate) fn store(&self) -> &dyn Store {
        &*self.inner.store
    }

    pub(crate) fn local(&self) -> Option<&MemoryStore> {
        self.inner.local.as_deref()
    }

    pub(crate) fn store_arc(&self) -> Arc<dyn Store> {
        self.inner.store.clone()
    }

    pub(crate) fn renewer(&self) -> &Arc<crate::lease::Renewer> {
        &self.inner.renewer
    }

    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn sql_stores(&self) -> &crate::store::SqlStores {
        &self.inner.tx
    }

    pub(crate) fn cache(&self) -> &ReplayCache {
        &self.inner.cache
    }

    pub(crate) fn max_outcome_bytes(&self) -> usize {
        self.inner.cfg.max_outcome_bytes
    }

    pub(crate) fn poll_interval(&self) -> Duration {
        self.inner.cfg.poll_interval
    }

    pub(crate) fn wake(&self, id: &OperationId) {
        self.inner.hub.wake(id);
    }

    pub(crate) fn register_waiter(&self, id: &OperationId) -> Option<Waiter> {
        self.inner.hub.register(id, self.inner.cfg.max_waiters)
    }

    /// A key or scope made what is stored: keyed-hashed when the builder asked for it, so
    /// raw keys and scopes (emails, account numbers, principals) never reach the table.
    pub(crate) fn store_key(&self, encoded: &mut String) {
        if let Some(secret) = &self.inner.cfg.hash_keys {
            let hashed = keyed_hex(&secret.0, encoded.as_bytes());
            encoded.clear();
            encoded.push_str("h:");
            encoded.push_str(&hashed);
        }
    }

    pub(crate) fn log_key<'k>(&self, key: &'k str) -> std::borrow::Cow<'k, str> {
        if self.inner.cfg.log_keys_hashed && !key.is_empty() && !key.starts_with("h:") {
            format!("h:{}", &hex_sha256(key.as_bytes())[..16]).into()
        } else {
            key.into()
        }
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// HMAC-SHA256 of `bytes` under `secret`, in hex.
pub(crate) fn keyed_hex(secret: &[u8], bytes: &[u8]) -> String {
    use hmac::Mac;
    let mut mac =
        hmac::Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(bytes);
    hex(&mac.finalize().into_bytes())
}

fn hex(digest: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(64);
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The background purge started by [`Idem::spawn_reaper`]; dropping it stops the task.
#[derive(Debug)]
pub struct ReaperHandle {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReaperHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}
