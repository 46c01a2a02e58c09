//! The `Idem` handle and its builder.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::cache::ReplayCache;
use crate::error::IdemError;
use crate::key::KeyPart;
use crate::op::Operation;
use crate::store::{ListFilter, OperationId, RecordInfo, Resolution, Stats, Store, StoredOutcome};
use crate::wake::{Waiter, WakeHub};

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
    tx: crate::tx::TxStores,
    hub: Arc<WakeHub>,
    cache: ReplayCache,
    cfg: Config,
}

#[derive(Clone, Debug)]
struct Config {
    max_outcome_bytes: usize,
    max_waiters: usize,
    poll_interval: Duration,
    renew_leases: bool,
    hash_keys: Option<crate::builder::Secret>,
    log_keys_hashed: bool,
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
    /// A process-local store, for tests and single-process tools.
    ///
    /// It deduplicates concurrent and repeated calls within this process only, and
    /// forgets everything when the process exits: a retry after a crash or from
    /// another instance runs the body again. Use the SQLite or PostgreSQL store where
    /// that matters.
    pub fn memory() -> Idem {
        Idem::builder().memory()
    }

    /// The embedded store: a SQLite file (created if missing, WAL mode) or
    /// `sqlite::memory:`. The schema is created on open.
    #[cfg(feature = "sqlite")]
    pub async fn sqlite(url: &str) -> Result<Idem, IdemError> {
        Idem::builder().sqlite(url).await
    }

    /// The production store on PostgreSQL (`postgres://…`), with a sqlx pool. Leases and
    /// expiry use the database's clock. Migrations run on open.
    #[cfg(feature = "postgres")]
    pub async fn postgres(url: &str) -> Result<Idem, IdemError> {
        Idem::builder().postgres(url).await
    }

    /// A store on the application's own sqlx pool (`PgPool` or `SqlitePool`).
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub async fn from_pool<P: crate::builder::IntoStore>(pool: P) -> Result<Idem, IdemError> {
        Idem::builder().pool(pool).await
    }

    /// Options beyond the defaults: table name, migrations, caps, key hashing.
    pub fn builder() -> crate::builder::IdemBuilder {
        crate::builder::IdemBuilder::default()
    }

    /// Sets the process-wide store used by `#[idempotent]` functions that name no
    /// `store`. A later call replaces it.
    pub fn set_global(idem: Idem) {
        *GLOBAL.write().unwrap_or_else(|p| p.into_inner()) = Some(idem);
    }

    /// The process-wide store, if one was set.
    pub fn global() -> Option<Idem> {
        GLOBAL.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Starts configuring one operation, identified by `name` and `key` (and, with
    /// [`Operation::scope`], a scope).
    pub fn operation<K: KeyPart + ?Sized>(&self, name: &str, key: &K) -> Operation {
        Operation::new(Some(self.clone()), name, key)
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
    /// [`Operation::id`] give it.
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
                outcome,
                version,
                retain,
            } => {
                let body = serde_json::to_vec(outcome).map_err(|e| IdemError::Codec {
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
                    is_err: false,
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

    pub(crate) fn from_store(
        store: Arc<dyn Store>,
        tx: crate::tx::TxStores,
        b: &crate::builder::IdemBuilder,
    ) -> Idem {
        let store = match &b.layer {
            Some(layer) => (layer.0)(store),
            None => store,
        };
        let hub = Arc::new(WakeHub::default());
        store.attach_wakers(hub.clone());
        Idem {
            inner: Arc::new(Inner {
                store,
                tx,
                hub,
                cache: ReplayCache::new(b.replay_cache_bytes),
                cfg: Config {
                    max_outcome_bytes: b.max_outcome_bytes,
                    max_waiters: b.max_waiters,
                    poll_interval: b.poll_interval,
                    renew_leases: b.renew_leases,
                    hash_keys: b.hash_keys.clone(),
                    log_keys_hashed: b.log_keys_hashed,
                },
            }),
        }
    }

    pub(crate) fn store(&self) -> &dyn Store {
        &*self.inner.store
    }

    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn tx_stores(&self) -> &crate::tx::TxStores {
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

    /// A key or scope as stored: keyed-hashed when the builder asked for it, so raw keys
    /// and scopes (emails, account numbers, principals) never reach the table.
    pub(crate) fn stored_key(&self, encoded: String) -> String {
        match &self.inner.cfg.hash_keys {
            Some(secret) => format!("h:{}", keyed_hex(&secret.0, encoded.as_bytes())),
            None => encoded,
        }
    }

    pub(crate) fn log_key<'k>(&self, key: &'k str) -> std::borrow::Cow<'k, str> {
        if self.inner.cfg.log_keys_hashed && !key.is_empty() && !key.starts_with("h:") {
            format!("h:{}", &hex_sha256(key.as_bytes())[..16]).into()
        } else {
            key.into()
        }
    }

    /// Keeps the lease of a running body alive until the returned [`Lease`] is dropped,
    /// and tracks how long the claim is known to be held.
    pub(crate) fn hold_lease(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
        claimed_at: tokio::time::Instant,
    ) -> Lease {
        let held_until = Arc::new(std::sync::Mutex::new(Some(claimed_at + lease)));
        if !self.inner.cfg.renew_leases {
            return Lease {
                held_until,
                task: None,
            };
        }
        let idem = self.clone();
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
                                Err(crate::error::StoreError::unreachable(
                                    "the lease renewal did not answer in time",
                                ))
                            });
                    match renewed {
                        Ok(crate::store::Fence::Held) => {
                            *held.lock().unwrap_or_else(|p| p.into_inner()) = Some(sent + lease);
                        }
                        Ok(crate::store::Fence::Lost) => {
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
