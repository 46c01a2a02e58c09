//! The `Idem` handle: what it holds (the store, its configuration, the replay cache,
//! the lease renewer, the wake-up hub) and the operator's calls on it (`stats`, `list`,
//! `get`, `resolve`, `forget`, `purge_expired`, the reaper, the global handle).
//! Opening one is in `builder.rs`; `Idem::operation` is in `op.rs`.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::cache::ReplayCache;
use crate::error::IdemError;
pub(crate) use crate::secret::Secret;
use crate::secret::{hex, keyed_hex};
use crate::store::wake::{Waiter, WakeHub};
use crate::store::{ListFilter, OperationId, RecordInfo, Resolution, Stats, Store, StoredOutcome};

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
///     .retain(std::time::Duration::from_secs(86_400))
///     .fingerprint_none()
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
    /// The same store when it is a SQL store, unwrapped: transactional mode runs its
    /// statements on the caller's connection instead.
    #[cfg(feature = "_sql")]
    sql: Option<crate::store::engine::SqlHandle>,
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
    pub(crate) store_timeout: Duration,
    pub(crate) renew_leases: bool,
    pub(crate) hash_keys: Option<Secret>,
    /// Under `hash_keys`, what request fingerprints are keyed with before they are stored.
    pub(crate) fingerprint_key: Option<crate::fingerprint::FingerprintKey>,
    pub(crate) log_keys_hashed: bool,
    /// The keys outcomes are sealed with, when they are encrypted (`seal.rs`).
    #[cfg(feature = "encryption")]
    pub(crate) keyring: Option<crate::Keyring>,
    /// The allowance of new claims (`limit.rs`), when they are limited.
    pub(crate) claim_limit: Option<Arc<crate::limit::ClaimLimiter>>,
    /// What the HTTP layer's status tokens are keyed with (`status_secret`, else
    /// `hash_keys`).
    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    pub(crate) status_secret: Option<Secret>,
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
    ///
    /// ```
    /// # use idem_runtime::{idempotent, Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// #[idempotent(key = id, retain = "1h")] // no `store`: the global one
    /// async fn notify(id: u64) -> Result<u64, IdemError> { Ok(id) }
    ///
    /// Idem::set_global(Idem::memory());
    /// assert_eq!(notify(7).await?, 7);
    /// # Ok(()) }
    /// ```
    pub fn set_global(idem: Idem) {
        *GLOBAL.write().unwrap_or_else(|p| p.into_inner()) = Some(idem);
    }

    /// The process-wide store, if one was set.
    ///
    /// ```
    /// # use idem_runtime::Idem;
    /// Idem::set_global(Idem::memory());
    /// let idem = Idem::global().expect("set at startup");
    /// # let _ = idem;
    /// ```
    pub fn global() -> Option<Idem> {
        GLOBAL.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Deletes completed records past their retention, and operations released with
    /// their [steps](crate::step) kept past theirs; returns how many. Claims in progress
    /// and UNKNOWN records are never purged.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::sqlite("sqlite::memory:").await?;
    /// let purged = idem.purge_expired().await?; // from a cron job or `spawn_reaper`
    /// assert_eq!(purged, 0);
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::sqlite("sqlite::memory:").await?;
    /// let reaper = idem.spawn_reaper(Duration::from_secs(600));
    /// // ... serve; the reaper purges every 10 minutes until dropped
    /// drop(reaper);
    /// # Ok(()) }
    /// ```
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
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let stats = idem.stats().await?;
    /// if stats.unknown > 0 || stats.oldest_in_progress > Some(Duration::from_secs(600)) {
    ///     eprintln!("idem needs an operator: {stats:?}");
    /// }
    /// # assert_eq!(stats.completed, 0);
    /// # Ok(()) }
    /// ```
    pub async fn stats(&self) -> Result<Stats, IdemError> {
        self.store()
            .stats()
            .await
            .map_err(|e| IdemError::store("stats", e))
    }

    /// Records matching `filter`, oldest first, for reconciliation.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, ListFilter};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// for record in idem.list(&ListFilter::unknown().limit(50)).await? {
    ///     let id = &record.id;
    ///     println!("{} {} {} at epoch {}", id.display_scope(), id.name, id.display_key(), record.epoch);
    /// }
    /// let last_hour = idem.list(&ListFilter::recent(Duration::from_secs(3600))).await?;
    /// # assert!(last_hour.is_empty());
    /// # Ok(()) }
    /// ```
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, IdemError> {
        self.store()
            .list(filter)
            .await
            .map_err(|e| IdemError::store("list", e))
    }

    /// One record in full (state, epoch, ages, lease, outcome, and the completed
    /// [steps](crate::step) of an operation not yet completed), or `None` when the store
    /// holds nothing for `id`. For operators; `id` as [`Idem::list`] or
    /// [`Operation::id`](crate::Operation::id) give it.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, State};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let charge = idem.operation("charge", "order-1").retain(Duration::from_secs(3600));
    /// let id = charge.id().clone();
    /// charge.fingerprint_none().run(|| async { Ok::<_, IdemError>(1999) }).await?;
    /// let record = idem.get(&id).await?.expect("recorded");
    /// assert_eq!(record.info.state, State::Completed);
    /// # Ok(()) }
    /// ```
    pub async fn get(
        &self,
        id: &OperationId,
    ) -> Result<Option<crate::store::RecordDetail>, IdemError> {
        let detail = self.store().get(id).await;
        let Some(mut detail) = detail.map_err(|e| IdemError::store("get", e))? else {
            return Ok(None);
        };
        // A completed operation replays its final outcome: its steps no longer count.
        if detail.info.state != crate::State::Completed {
            let steps = self.store().steps(id).await;
            detail.steps = steps.map_err(|e| IdemError::store("get", e))?;
        }
        // Encrypted values opened where this handle's keyring can; one it cannot stays
        // sealed (`StoredOutcome::sealed_key_id` names its key), so an operator can still
        // see, resolve or forget the record.
        let part = crate::seal::Part::Outcome;
        if let Some(outcome) = &mut detail.outcome {
            self.open_in_place(id, part, outcome);
        }
        for step in &mut detail.steps {
            let part = crate::seal::Part::Step(&step.label);
            self.open_in_place(id, part, &mut step.outcome);
        }
        Ok(Some(detail))
    }

    /// Settles an UNKNOWN (or stuck IN_PROGRESS) operation at `epoch` (from
    /// [`Idem::list`] or [`IdemError::Unknown`]). Returns [`IdemError::Fenced`] when the
    /// record is no longer at that epoch.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, ListFilter, Resolution};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// for record in idem.list(&ListFilter::unknown()).await? {
    ///     // The provider's dashboard says this charge went through: record what it returned.
    ///     let outcome = serde_json::json!({ "charge": "ch_123" });
    ///     let done = Resolution::Completed { outcome, version: 1, retain: Duration::from_secs(86_400) };
    ///     idem.resolve(&record.id, record.epoch, done).await?;
    /// }
    /// # Ok(()) }
    /// ```
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
                        in_doubt: false,
                    });
                }
                let is_err = matches!(resolution, Resolution::Rejected { .. });
                // Sealed as the operation's own outcome would be: it is replayed alike.
                let body = self.seal(id, crate::seal::Part::Outcome, is_err, *version, body)?;
                let stored = StoredOutcome::new(body, is_err, *version);
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
                tracing::info!(scope = ?self.log_key(&id.scope), name = ?id.name, key = ?self.log_key(&id.key), epoch, ?resolution, "resolved");
                Ok(())
            }
            crate::store::Fence::Lost => Err(IdemError::Fenced {
                name: id.name.clone(),
                epoch,
            }),
        }
    }

    /// Deletes the record of `id` held at `epoch` (from [`Idem::get`] or [`Idem::list`]),
    /// so the next call runs the body: an operator's undo of a wrong outcome, such as a
    /// mistaken [`Resolution::Completed`]. It deletes a COMPLETED or UNKNOWN record, or an
    /// IN_PROGRESS one whose lease has lapsed; never a claim whose lease holds (its body
    /// may be running). Returns `false`, deleting nothing, when the record is gone, at
    /// another epoch, or in progress under a live lease: read it again and decide again.
    ///
    /// The next call binds its own fingerprint, so a forgotten key may be reused with
    /// another payload. This handle's replay cache drops the outcome at once; other
    /// processes that recorded or replayed it in the last minute may still replay it from
    /// their own cache until the entry ages out (at most 60 s). Epochs never repeat, so no
    /// late writer of an older claim lands.
    ///
    /// ```
    /// use idem_runtime::{Idem, IdemError};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let send = |text: &'static str| {
    ///     idem.operation("send", "msg-1")
    ///         .retain(Duration::from_secs(3600))
    ///         .fingerprint_none()
    ///         .run(move || async move { Ok::<_, IdemError>(text.to_owned()) })
    /// };
    /// assert_eq!(send("first").await?, "first");
    /// let id = idem.operation("send", "msg-1").id().clone();
    /// let record = idem.get(&id).await?.expect("recorded");
    /// assert!(idem.forget(&id, record.info.epoch).await?);
    /// assert_eq!(send("again").await?, "again"); // the body ran again
    /// # Ok(()) }
    /// ```
    pub async fn forget(&self, id: &OperationId, epoch: u64) -> Result<bool, IdemError> {
        let fence = self
            .store()
            .forget(id, epoch)
            .await
            .map_err(|e| IdemError::store("forget", e))?;
        let forgotten = fence == crate::store::Fence::Held;
        if forgotten {
            self.cache().forget(id);
            self.wake(id);
            tracing::info!(scope = ?self.log_key(&id.scope), name = ?id.name, key = ?self.log_key(&id.key), epoch, "forgotten");
        }
        Ok(forgotten)
    }

    pub(crate) fn new(
        store: Arc<dyn Store>,
        #[cfg(feature = "_sql")] sql: Option<crate::store::engine::SqlHandle>,
        cfg: Config,
        replay_cache_bytes: usize,
    ) -> Idem {
        let hub = Arc::new(WakeHub::default());
        store.attach_wakers(hub.clone());
        Idem {
            inner: Arc::new(Inner {
                store,
                #[cfg(feature = "_sql")]
                sql,
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

    pub(crate) fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub(crate) fn renewer(&self) -> &Arc<crate::lease::Renewer> {
        &self.inner.renewer
    }

    /// The SQL store this `Idem` was opened on, for transactional mode.
    #[cfg(feature = "_sql")]
    pub(crate) fn sql_store(&self) -> Option<&crate::store::engine::SqlHandle> {
        self.inner.sql.as_ref()
    }

    pub(crate) fn cache(&self) -> &ReplayCache {
        &self.inner.cache
    }

    #[cfg(feature = "encryption")]
    pub(crate) fn keyring(&self) -> Option<&crate::Keyring> {
        self.inner.cfg.keyring.as_ref()
    }

    pub(crate) fn max_outcome_bytes(&self) -> usize {
        self.inner.cfg.max_outcome_bytes
    }

    pub(crate) fn poll_interval(&self) -> Duration {
        self.inner.cfg.poll_interval
    }

    #[cfg(feature = "axum")]
    pub(crate) fn status_secret(&self) -> Option<&[u8]> {
        self.inner.cfg.status_secret.as_ref().map(|s| &*s.0)
    }

    pub(crate) fn claim_limit(&self) -> Option<&Arc<crate::limit::ClaimLimiter>> {
        self.inner.cfg.claim_limit.as_ref()
    }

    pub(crate) fn store_timeout(&self) -> Duration {
        self.inner.cfg.store_timeout
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

    /// A request fingerprint made what is stored: under `hash_keys` its HMAC, so the
    /// table holds nothing a dictionary of likely requests can be checked against; else
    /// as computed. Every store, transactional mode and the replay cache see this form.
    pub(crate) fn store_fingerprint(&self, fingerprint: [u8; 32]) -> [u8; 32] {
        match &self.inner.cfg.fingerprint_key {
            Some(key) => key.apply(fingerprint),
            None => fingerprint,
        }
    }

    /// A stored key or scope as tracing events show it (see
    /// [`IdemBuilder::log_keys_hashed`](crate::IdemBuilder::log_keys_hashed)): under
    /// `hash_keys` the keyed digest, which is what is stored, so events match what
    /// `list` shows; else an unkeyed digest when asked for, else as stored.
    pub(crate) fn log_key<'k>(&self, key: &'k str) -> std::borrow::Cow<'k, str> {
        let cfg = &self.inner.cfg;
        match &cfg.hash_keys {
            _ if key.is_empty() => key.into(),
            // Every key and scope an operation stores is `h:` and its HMAC already.
            Some(_) if key.starts_with("h:") => key.into(),
            // One the caller spelled out (an id given to `resolve`), not yet hashed.
            Some(secret) => format!("h:{}", keyed_hex(&secret.0, key.as_bytes())).into(),
            None if cfg.log_keys_hashed => {
                format!("h:{}", &hex_sha256(key.as_bytes())[..16]).into()
            }
            None => key.into(),
        }
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
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

/// Sealing and opening through this handle's keyring (`seal.rs` does the work).
impl Idem {
    fn keys(&self) -> crate::seal::Keys<'_> {
        #[cfg(feature = "encryption")]
        return self.keyring();
        #[cfg(not(feature = "encryption"))]
        None
    }

    /// `body` as it is stored for `part` of `id`: sealed under the keyring's current key
    /// when this `Idem` encrypts, else as it is.
    pub(crate) fn seal(
        &self,
        id: &OperationId,
        part: crate::seal::Part<'_>,
        is_err: bool,
        version: u32,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, IdemError> {
        crate::seal::seal(self.keys(), id, part, is_err, version, body)
    }

    /// The clear body of a stored one; [`IdemError::Undecryptable`] when it is sealed
    /// and cannot be opened here.
    pub(crate) fn open<'b>(
        &self,
        id: &OperationId,
        part: crate::seal::Part<'_>,
        is_err: bool,
        version: u32,
        body: &'b [u8],
    ) -> Result<std::borrow::Cow<'b, [u8]>, IdemError> {
        crate::seal::open(self.keys(), id, part, is_err, version, body)
    }

    /// `outcome` opened in place where this handle can open it; left sealed where it
    /// cannot, for an operator's view of the record.
    pub(crate) fn open_in_place(
        &self,
        id: &OperationId,
        part: crate::seal::Part<'_>,
        outcome: &mut StoredOutcome,
    ) {
        crate::seal::open_in_place(self.keys(), id, part, outcome);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};

    use super::*;
    use crate::KeyPart;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    /// Collects the `key` field of every span opened, as events would show it.
    #[derive(Default)]
    struct SpanKeys {
        next: AtomicU64,
        keys: Arc<Mutex<Vec<String>>>,
    }

    struct KeyField<'a>(&'a mut Option<String>);

    impl Visit for KeyField<'_> {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "key" {
                *self.0 = Some(format!("{value:?}"));
            }
        }
    }

    impl tracing::Subscriber for SpanKeys {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            let mut key = None;
            span.record(&mut KeyField(&mut key));
            self.keys.lock().unwrap().extend(key);
            Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, _: &tracing::Event<'_>) {}
        fn enter(&self, _: &Id) {}
        fn exit(&self, _: &Id) {}
    }

    /// The key a call of `key` on `idem` shows in its tracing span, without the quotes
    /// it is logged in.
    fn logged_key<K: KeyPart + ?Sized>(idem: &Idem, key: &K) -> String {
        let spans = SpanKeys::default();
        let keys = spans.keys.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tracing::subscriber::with_default(spans, || {
            rt.block_on(
                idem.operation("charge", key)
                    .retain(Duration::from_secs(60))
                    .fingerprint_none()
                    .run(|| async { Ok::<_, IdemError>(1u8) }),
            )
            .unwrap();
        });
        let keys = keys.lock().unwrap();
        let logged = keys.first().expect("no span carried the key");
        let unquoted = logged.strip_prefix('"').and_then(|k| k.strip_suffix('"'));
        unquoted.expect("the key is logged quoted").to_owned()
    }

    #[test]
    fn hashed_keys_are_logged_as_their_keyed_digest() {
        let encoded = "order-1001".encode_key();
        let keyed = format!("h:{}", keyed_hex(SECRET, encoded.as_bytes()));
        let plain = hex_sha256(encoded.as_bytes());
        for log_hashed in [true, false] {
            let idem = Idem::builder()
                .hash_keys(SECRET)
                .log_keys_hashed(log_hashed)
                .memory();
            let logged = logged_key(&idem, "order-1001");
            assert_eq!(logged, keyed, "log_keys_hashed({log_hashed})");
            assert!(!logged.contains(&plain[..16]), "{logged}");
            assert!(!logged.contains("order-1001"), "{logged}");
        }
    }

    /// A key type whose encoding begins like a stored digest.
    struct Tagged;

    impl KeyPart for Tagged {
        fn write_key(&self, out: &mut String) {
            out.push_str("h:order-1001");
        }
    }

    #[test]
    fn without_a_secret_keys_are_logged_as_a_plain_digest() {
        let idem = Idem::builder().log_keys_hashed(true).memory();
        let encoded = "order-1001".encode_key();
        let plain = format!("h:{}", &hex_sha256(encoded.as_bytes())[..16]);
        assert_eq!(logged_key(&idem, "order-1001"), plain);
        // Whatever a key's encoding looks like, it is hashed, never shown as given.
        let tagged = format!("h:{}", &hex_sha256(b"h:order-1001")[..16]);
        assert_eq!(logged_key(&idem, &Tagged), tagged);
        // Unhashed, a key is logged as the application passed it.
        let shown = Idem::builder().memory();
        assert_eq!(logged_key(&shown, "order-1001"), "order-1001");
    }

    async fn charge(idem: &Idem, cents: u64, runs: &AtomicU64) -> Result<u64, IdemError> {
        let request = ("acme-corp", 48213u64, cents);
        idem.operation("charge", &request.1)
            .scope(request.0)
            .retain(Duration::from_secs(60))
            .fingerprint(&request)
            .run(|| async move {
                runs.fetch_add(1, Ordering::Relaxed);
                Ok::<_, IdemError>(cents)
            })
            .await
    }

    /// A forgotten record is not replayed from this handle's replay cache either: the
    /// next call runs the body.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_forgotten_outcome_leaves_the_replay_cache() {
        let idem = Idem::sqlite("sqlite::memory:").await.unwrap();
        let send = |text: &'static str| {
            idem.operation("send", "msg-1")
                .retain(Duration::from_secs(3600))
                .fingerprint_none()
                .run(move || async move { Ok::<_, IdemError>(text.to_owned()) })
        };
        assert_eq!(send("first").await.unwrap(), "first");
        assert_eq!(send("replayed").await.unwrap(), "first");
        let id = idem.operation("send", "msg-1").id().clone();
        let epoch = idem.get(&id).await.unwrap().expect("recorded").info.epoch;
        assert!(idem.forget(&id, epoch).await.unwrap());
        assert_eq!(
            send("again").await.unwrap(),
            "again",
            "replayed from the cache"
        );
    }

    /// Under `hash_keys` the table holds the fingerprint keyed (HMAC-SHA256 of it, under
    /// a key derived from the secret), never the plain SHA-256 a dictionary of likely
    /// requests could be checked against; another request is still a mismatch and the
    /// same one still replays, from the replay cache and from the store.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn hashed_keys_store_the_fingerprint_keyed() {
        use hmac::Mac;
        let path = std::env::temp_dir().join(format!("idem-keyed-fp-{}.db", std::process::id()));
        let url = format!("sqlite://{}", path.display());
        let runs = AtomicU64::new(0);
        let idem = Idem::builder()
            .hash_keys(SECRET)
            .sqlite(&url)
            .await
            .unwrap();
        assert_eq!(charge(&idem, 2500, &runs).await.unwrap(), 2500);

        let table = sqlx::SqlitePool::connect(&url).await.unwrap();
        let stored: Vec<u8> = sqlx::query_scalar("SELECT fingerprint FROM idem_operations")
            .fetch_one(&table)
            .await
            .unwrap();
        table.close().await;
        let plain = crate::fingerprint::fingerprint(&("acme-corp", 48213u64, 2500u64)).unwrap();
        assert_ne!(stored, plain, "the plain SHA-256 reached the table");
        let derived = hmac::Hmac::<Sha256>::new_from_slice(SECRET)
            .unwrap()
            .chain_update(b"idem fingerprint key v1")
            .finalize()
            .into_bytes();
        let keyed = hmac::Hmac::<Sha256>::new_from_slice(&derived)
            .unwrap()
            .chain_update(plain)
            .finalize()
            .into_bytes();
        assert_eq!(stored, keyed.to_vec());

        let uncached = Idem::builder()
            .hash_keys(SECRET)
            .replay_cache_bytes(0)
            .sqlite(&url)
            .await
            .unwrap();
        for handle in [&idem, &uncached] {
            assert_eq!(charge(handle, 2500, &runs).await.unwrap(), 2500);
            let other = charge(handle, 9999, &runs).await;
            assert!(
                matches!(other, Err(IdemError::Mismatch { .. })),
                "{other:?}"
            );
        }
        assert_eq!(runs.load(Ordering::Relaxed), 1);
        drop((idem, uncached));
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }

    #[test]
    fn every_store_refuses_a_short_secret() {
        let short = Secret(Arc::from(&b"short"[..]));
        assert!(matches!(short.check(), Err(IdemError::Config { .. })));
        assert!(Secret(Arc::from(SECRET)).check().is_ok());
        let memory = std::panic::catch_unwind(|| Idem::builder().hash_keys(b"short").memory());
        assert!(memory.is_err(), "the memory store took a 5-byte secret");
    }
}
