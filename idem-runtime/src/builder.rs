//! Options for an [`Idem`] beyond the defaults, and the openers of the stores that are no
//! SQL backend (memory, Redis, a store of your own, an application's pool). Each SQL
//! backend's own opener (`Idem::sqlite`, `IdemBuilder::postgres`, ...) is in its folder
//! under `store/`, beside its dialect.

use std::sync::Arc;
use std::time::Duration;

#[allow(unused_imports)]
use crate::error::IdemError;
use crate::idem::{Config, Idem, Secret};
use crate::store::Store;
#[cfg(feature = "_sql")]
use crate::store::engine::SqlHandle;
#[cfg(feature = "_sql")]
use crate::store::engine::{Dialect, SqlDb, SqlOptions, SqlStore};

/// Default cap on a recorded outcome's JSON, in bytes.
pub const DEFAULT_MAX_OUTCOME_BYTES: usize = 64 * 1024;
const DEFAULT_MAX_WAITERS: usize = 1024;
const DEFAULT_REPLAY_CACHE_BYTES: usize = 4 * 1024 * 1024;
const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How long a claim (or a replay's read) waits for the store's answer by default.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);

impl Idem {
    /// A process-local store, for tests and single-process tools.
    ///
    /// It deduplicates concurrent and repeated calls within this process only, and
    /// forgets everything when the process exits: a retry after a crash or from
    /// another instance runs the body again. Use the SQLite or PostgreSQL store where
    /// that matters.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::memory();
    /// let n = idem
    ///     .operation("count", "c-1")
    ///     .retain(Duration::from_secs(60))
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>(1) })
    ///     .await?;
    /// # assert_eq!(n, 1);
    /// # Ok(()) }
    /// ```
    pub fn memory() -> Idem {
        IdemBuilder::default().memory()
    }

    /// The store on Redis or Valkey (`redis://…`), keys under the prefix `idem`. Every
    /// state change is one Lua script; leases and expiry use the server's clock. See
    /// [`store::redis`](crate::store::redis) for the durability each server
    /// configuration gives.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::redis("redis://cache.internal:6379").await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub async fn redis(url: &str) -> Result<Idem, IdemError> {
        IdemBuilder::default().redis(url).await
    }

    /// A store on the application's own sqlx pool (`PgPool`, `MySqlPool` or `SqlitePool`,
    /// each with its store's feature).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::BoxError> {
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?; // the application's pool
    /// let idem = Idem::from_pool(pool).await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "_sql")]
    pub async fn from_pool<P: IntoStore>(pool: P) -> Result<Idem, IdemError> {
        IdemBuilder::default().pool(pool).await
    }

    /// Options beyond the defaults: table name, migrations, caps, key hashing.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .max_outcome_bytes(16 * 1024)
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn builder() -> IdemBuilder {
        IdemBuilder::default()
    }
}

/// Builds an [`Idem`] with non-default options; made by [`Idem::builder`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::IdemError> {
/// let idem = idem_runtime::Idem::builder()
///     .table("billing_idempotency")
///     .max_outcome_bytes(16 * 1024)
///     .hash_keys(b"a secret of at least 32 random bytes from your vault")
///     .sqlite("sqlite::memory:")
///     .await?;
/// # let _ = idem; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct IdemBuilder {
    pub(crate) max_outcome_bytes: usize,
    pub(crate) replay_cache_bytes: usize,
    pub(crate) max_waiters: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) renew_leases: bool,
    /// The secret keys and scopes are HMAC'd with, when they are stored hashed.
    pub(crate) hash_keys: Option<Secret>,
    pub(crate) log_keys_hashed: bool,
    #[cfg_attr(not(feature = "_sql"), allow(dead_code))]
    pub(crate) table: Option<String>,
    #[cfg_attr(not(feature = "_sql"), allow(dead_code))]
    pub(crate) migrate: bool,
    #[cfg_attr(not(feature = "_sql"), allow(dead_code))]
    pub(crate) max_connections: Option<u32>,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) group_commit: bool,
    pub(crate) layer: Option<StoreLayer>,
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) key_prefix: Option<String>,
    /// A PEM CA the network stores' certificates may chain to.
    #[cfg_attr(
        not(any(feature = "tls-rustls", feature = "tls-native-tls")),
        allow(dead_code)
    )]
    pub(crate) root_cert: Option<Vec<u8>>,
    /// The keys outcomes are sealed with, when they are encrypted.
    #[cfg(feature = "encryption")]
    pub(crate) keyring: Option<crate::Keyring>,
    /// The allowance of new claims, when they are limited.
    pub(crate) claim_limit: Option<crate::ClaimLimit>,
    /// What status tokens are keyed with, when not the `hash_keys` secret.
    pub(crate) status_secret: Option<Secret>,
}

/// A function wrapping the opened store, set with [`IdemBuilder::layer`].
type LayerFn = dyn Fn(Arc<dyn Store>) -> Arc<dyn Store> + Send + Sync;

/// A [`LayerFn`] the builder can clone and print.
#[derive(Clone)]
pub(crate) struct StoreLayer(pub(crate) Arc<LayerFn>);

impl std::fmt::Debug for StoreLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreLayer")
    }
}

impl Default for IdemBuilder {
    fn default() -> Self {
        IdemBuilder {
            max_outcome_bytes: DEFAULT_MAX_OUTCOME_BYTES,
            replay_cache_bytes: DEFAULT_REPLAY_CACHE_BYTES,
            max_waiters: DEFAULT_MAX_WAITERS,
            poll_interval: DEFAULT_POLL_INTERVAL,
            store_timeout: DEFAULT_STORE_TIMEOUT,
            renew_leases: true,
            hash_keys: None,
            log_keys_hashed: false,
            table: None,
            migrate: true,
            max_connections: None,
            group_commit: true,
            layer: None,
            key_prefix: None,
            root_cert: None,
            #[cfg(feature = "encryption")]
            keyring: None,
            claim_limit: None,
            status_secret: None,
        }
    }
}

impl IdemBuilder {
    /// The table holding the records (default `idem_operations`); on PostgreSQL it may
    /// be schema-qualified (`billing.idem_operations`).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .table("billing_idempotency")
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = Some(table.into());
        self
    }

    /// Whether to create or migrate the schema on open (default `true`). Teams that
    /// run their own DDL set `false` and apply the SQL in `idem_runtime::schema` themselves.
    /// On Redis, which has no schema, `false` writes nothing on open: an application must
    /// have opened a store under the key prefix already, with the same
    /// [`hash_keys`](Self::hash_keys), or the open is an [`IdemError::Config`].
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// // The schema comes from the team's own migrations (`idem_runtime::schema`).
    /// let idem = Idem::builder()
    ///     .migrate(false)
    ///     .postgres("postgres://app@db.internal:5432/app")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Connections that [`IdemBuilder::postgres`] holds for claims, records and lease
    /// renewals (default 16; size it to the number of concurrent callers).
    ///
    /// It does not bound the whole of what idem holds on PostgreSQL: beside these, a
    /// sqlx pool of up to 4 serves migrations and the operations queries, and 1
    /// connection listens for wake-ups, so the store holds up to `max + 5` connections
    /// (21 by default) to the server, shared by every clone of its `Idem`. Give the
    /// server that many free slots per `Idem` opened; an open that finds none fails at
    /// once with the server's reason and these numbers.
    ///
    /// On MySQL, the size of the one pool [`IdemBuilder::mysql`] opens (default 16),
    /// which is all it holds. Not used with [`IdemBuilder::pool`], whose pool is the
    /// application's (on PostgreSQL the listener still adds one connection), nor on
    /// Redis, whose commands share two multiplexed connections.
    ///
    /// With the `postgres` or `mysql` feature.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .max_connections(32) // the server then sees up to 37 of idem's connections
    ///     .postgres("postgres://app@db.internal:5432/app")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "_sql_server")]
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = Some(max);
        self
    }

    /// The prefix of the Redis keys holding the records (default `idem`): stores with
    /// other prefixes share a server without seeing each other's records. No braces
    /// (they would change the keys' cluster hash tag).
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .key_prefix("billing-idem")
    ///     .redis("redis://cache.internal:6379")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }

    /// Trusts `pem` (one or more CA certificates in PEM) for the TLS connections of the
    /// network stores, beside the default roots: for a server whose certificate chains
    /// to a private CA or a provider's own (RDS, Cloud SQL). On PostgreSQL and MySQL it
    /// is what `sslrootcert=` / `ssl-ca=` in the URL does; on Redis (`rediss://`) it is
    /// the only way. The URL still says whether to use TLS and how strictly to verify.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let ca = std::fs::read("/etc/idem/redis-ca.pem")?;
    /// let idem = Idem::builder()
    ///     .tls_root_certificate(ca)
    ///     .redis("rediss://cache.internal:6380")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(feature = "tls-rustls", feature = "tls-native-tls")))
    )]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_cert = Some(pem.into());
        self
    }

    /// Cap on a recorded outcome's JSON, in bytes (default 64 KiB).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder().max_outcome_bytes(256 * 1024).memory();
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn max_outcome_bytes(mut self, max: usize) -> Self {
        self.max_outcome_bytes = max;
        self
    }

    /// Memory, in bytes, for the outcomes this process recorded, kept so a retry that
    /// returns to the same process replays without a round trip (default 4 MiB; 0 turns
    /// it off). The budget counts everything the cache holds: keys, outcomes and its
    /// own bookkeeping, each heap block as `malloc` sizes it. An entry lives at most 60
    /// seconds and never past its record's retention, and expired entries are dropped
    /// as new ones come in; completed records do not change before they expire, so the
    /// cache is safe with other processes on the same store. Records deleted by hand
    /// may still be replayed from it for up to a minute.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .replay_cache_bytes(0) // every replay reads the store
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn replay_cache_bytes(mut self, bytes: usize) -> Self {
        self.replay_cache_bytes = bytes;
        self
    }

    /// Cap on the callers of this process waiting on one in-flight key (default
    /// 1024); past it they get [`IdemError::TooManyWaiters`] at once.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder().max_waiters(64).memory();
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn max_waiters(mut self, max: usize) -> Self {
        self.max_waiters = max;
        self
    }

    /// How often a waiter re-checks an in-flight operation when no wake-up arrives
    /// (changes made by other processes on stores without notifications). Default 200ms.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .poll_interval(Duration::from_millis(50))
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// How long a call waits for the store's answer to a claim, or to the read that
    /// looks for a replay, before it gives up with a retryable [`IdemError::Store`]
    /// (the body did not run). `fail_open` does not run the body on it: a silent store
    /// cannot be told from a claim waiting on a lock another call holds, so only a
    /// connection that fails (refused, reset, closed) counts as unreachable.
    /// Default 5 seconds.
    ///
    /// Every other statement waits for the store at most this long too, and at most a
    /// lease: a release, a renewal (and at most a third of the lease), each attempt of
    /// a record (and at most half a lease). A record's attempts together get what is
    /// left of the lease, then the call ends [`IdemError::Unrecorded`]. So during a
    /// network partition a call answers within the store timeout (before its body) or
    /// about one lease (after it), never later; retry it with the same key once the
    /// store is back. A connection whose statement timed out is closed at once, never
    /// reused mid-protocol nor kept waiting, so a connection gone silent is replaced by
    /// the next call (on Redis, the client's response timeout is this timeout too).
    ///
    /// The bound includes the wait for one of idem's connections: under a load the
    /// connections cannot keep up with, calls that would queue past it are shed with the
    /// same retryable error instead of piling up. Size it above the longest queueing
    /// delay you accept at peak.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .store_timeout(Duration::from_secs(2))
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Whether a running body's lease is renewed in the background (default `true`).
    /// Turning it off makes a body that outlives its lease lose its claim; meant for
    /// tests of takeover and fencing. ([`IdemBuilder::memory`]'s store, in the call's
    /// own process, holds a running call's claim while the call lives instead of
    /// renewing it; off, its leases lapse like any store's.)
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// // A test of takeover: claims lapse after their lease however long the body runs.
    /// let idem = Idem::builder().renew_leases(false).memory();
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn renew_leases(mut self, renew: bool) -> Self {
        self.renew_leases = renew;
        self
    }

    /// Store keys and scopes as HMAC-SHA256 digests keyed with `secret`, so raw keys and
    /// scopes (emails, account numbers, principals) never reach the table and a
    /// dictionary cannot reverse them without the secret. `list` then shows digests.
    ///
    /// Request fingerprints are keyed too (HMAC-SHA256 under a key derived from the
    /// secret): a fingerprint covers the request's parameters, so an unkeyed one would
    /// let a dictionary of likely requests recover them, key and scope included.
    ///
    /// Outcomes are stored as they are unless [`encrypt`](Self::encrypt) (feature
    /// `encryption`) seals them: without it, what a function returns is readable by
    /// whoever reads the table.
    ///
    /// The mode (and a check value of the secret) is recorded with the records at first
    /// open (in the SQL stores' table, under the Redis key prefix); opening them later
    /// without hashing, or with another secret, is a [`IdemError::Config`] rather than a
    /// silent change of every operation's identity.
    /// Keep the secret stable: changing it makes every recorded operation new.
    ///
    /// The secret must be at least 16 bytes (32 random bytes are best), on every store:
    /// opening one with a shorter secret is an [`IdemError::Config`], and
    /// [`memory`](Self::memory) and [`store`](Self::store), which return no `Result`,
    /// panic with the same message.
    ///
    /// Tracing events show keys and scopes as these keyed digests too (see
    /// [`log_keys_hashed`](Self::log_keys_hashed)).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let secret = std::env::var("IDEM_KEY_SECRET").unwrap_or_else(|_| "x".repeat(32));
    /// let idem = Idem::builder()
    ///     .hash_keys(secret)
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn hash_keys(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.hash_keys = Some(Secret(secret.as_ref().into()));
        self
    }

    /// Encrypts what idem stores of an operation's result under `keyring`: outcomes,
    /// recorded errors, [step](crate::step) values and operators' resolutions (so the
    /// HTTP layer's recorded responses and MCP tools' results too), on every store and in
    /// transactional mode, with XChaCha20-Poly1305, a fresh random nonce per write and
    /// the record's identity as associated data (see [`Keyring`](crate::Keyring) for
    /// rotation). With the `encryption` feature.
    ///
    /// A record that cannot be opened (its key id is not in the keyring, or it was
    /// altered or copied from another record) is [`IdemError::Undecryptable`], naming the
    /// key id, and is never replayed. Records stored in clear before encryption was turned
    /// on still replay until they expire; an `Idem` opened without the keyring reads no
    /// encrypted record. Keys, scopes and fingerprints are not encrypted: they are what
    /// the store matches on; [`hash_keys`](Self::hash_keys) keys them instead. This
    /// process's replay cache holds outcomes sealed, as the store does.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::IdemError> {
    /// use idem_runtime::{Idem, IdemError, Keyring};
    /// // From a secrets manager in production; `id:hex` entries, the current key first.
    /// let keys: Keyring = std::env::var("IDEM_KEYRING")
    ///     .unwrap_or_else(|_| format!("2026-03:{}", "42".repeat(32)))
    ///     .parse()?;
    /// let idem = Idem::builder().encrypt(keys).sqlite("sqlite::memory:").await?;
    /// let receipt = idem
    ///     .operation("charge", "order-1")
    ///     .retain(std::time::Duration::from_secs(3600))
    ///     .fingerprint_none()
    ///     .run(|| async { Ok::<_, IdemError>("card ending 4242".to_owned()) })
    ///     .await?;
    /// # assert_eq!(receipt, "card ending 4242");
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "encryption")]
    #[cfg_attr(docsrs, doc(cfg(feature = "encryption")))]
    pub fn encrypt(mut self, keyring: crate::Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// Limits the new operations a caller may start, apart from replays (default: no
    /// limit). Only a call that would create a record is counted and refused: one that
    /// finds its outcome recorded (a replay), waits on or is refused by a duplicate in
    /// flight, takes over a lapsed claim, or reuses a key with another payload is not. A
    /// refused call runs nothing, writes nothing, and fails with
    /// [`IdemError::RateLimited`], which the HTTP layer answers `429` with `Retry-After`,
    /// an MCP tool as a `rate_limited` error, and the queue mapping as a delayed
    /// redelivery.
    ///
    /// To tell a replay from a new call, the store reads before every claim (on
    /// PostgreSQL, MySQL and Redis it otherwise skips that read while calls are fresh):
    /// one read more per new operation.
    ///
    /// The count is per process unless the limit is [`shared`](crate::ClaimLimit::shared);
    /// opening an `Idem` with a shared limit on a store that cannot hold the count
    /// fails (on [`memory`](Self::memory) and [`store`](Self::store), which return no
    /// `Result`, it panics).
    ///
    /// ```
    /// # use idem_runtime::{ClaimLimit, Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .limit_new_claims(ClaimLimit::new(1, Duration::from_secs(60)))
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// let charge = |key: &'static str| {
    ///     idem.operation("charge", key)
    ///         .scope("customer-7")
    ///         .retain(Duration::from_secs(3600))
    ///         .fingerprint_none()
    ///         .run(|| async { Ok::<_, IdemError>(key.len()) })
    /// };
    /// charge("order-1").await?;
    /// charge("order-1").await?; // a replay: not counted
    /// let refused = charge("order-2").await.unwrap_err(); // a second new operation
    /// assert!(matches!(refused, IdemError::RateLimited { .. }));
    /// # Ok(()) }
    /// ```
    pub fn limit_new_claims(mut self, limit: crate::ClaimLimit) -> Self {
        self.claim_limit = Some(limit);
        self
    }

    /// The secret the HTTP layer keys its status tokens with: the URLs of requests a
    /// route accepted (`202`) with
    /// [`IdempotencyLayer::accept_after`](crate::http::IdempotencyLayer::accept_after).
    /// Without it the [`hash_keys`](Self::hash_keys) secret is used; a layer that
    /// accepts requests needs one or the other. At least 16 bytes (32 random bytes are
    /// best), the same on every instance, and stable: a new secret makes every
    /// outstanding status URL a 404.
    ///
    /// ```
    /// # use idem_runtime::Idem;
    /// let secret = std::env::var("IDEM_STATUS_SECRET").unwrap_or_else(|_| "x".repeat(32));
    /// let idem = Idem::builder().status_secret(secret).memory();
    /// # let _ = idem;
    /// ```
    pub fn status_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.status_secret = Some(Secret(secret.as_ref().into()));
        self
    }

    /// Show keys and scopes in tracing events as digests rather than as given (default
    /// `false`). What that protects depends on [`hash_keys`](Self::hash_keys):
    ///
    /// - Without a `hash_keys` secret, an event shows an unkeyed SHA-256 of the key,
    ///   truncated (`h:` and 16 hex digits). That keeps keys from a casual reader of the
    ///   logs, not from anyone who has them: a guessable key (an order number, an email)
    ///   is found by hashing candidates until one matches.
    /// - With a `hash_keys` secret, keys and scopes are stored as their HMAC under the
    ///   secret, and every event shows that keyed digest (`h:` and 64 hex digits, as
    ///   [`Idem::list`] shows the record), whatever this setting says. A dictionary
    ///   attack on it needs the secret.
    ///
    /// Where keys are personal data or otherwise sensitive, set `hash_keys`.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .log_keys_hashed(true) // events show `h:…` digests, not customer emails
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn log_keys_hashed(mut self, hash: bool) -> Self {
        self.log_keys_hashed = hash;
        self
    }

    /// Wraps the store this builder opens in one of your own (metrics, tracing, fault
    /// injection in tests): `layer` receives the opened store and returns the store the
    /// `Idem` uses, which should forward every method it does not change.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::IdemError> {
    /// let idem = idem_runtime::Idem::builder()
    ///     .layer(|store| store) // a wrapper would go here
    ///     .sqlite("sqlite::memory:")
    ///     .await?;
    /// # let _ = idem; Ok(()) }
    /// ```
    pub fn layer(
        mut self,
        layer: impl Fn(Arc<dyn Store>) -> Arc<dyn Store> + Send + Sync + 'static,
    ) -> Self {
        self.layer = Some(StoreLayer(Arc::new(layer)));
        self
    }

    /// A process-local store; see [`Idem::memory`]. It has no replay cache in front:
    /// the store is itself in this process's memory, so a cache would only add a copy.
    ///
    /// # Panics
    ///
    /// If the [`hash_keys`](Self::hash_keys) secret is shorter than 16 bytes.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder().max_outcome_bytes(1024).memory();
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn memory(mut self) -> Idem {
        self.replay_cache_bytes = 0;
        let store = Arc::new(crate::store::MemoryStore::default());
        self.finish_with(
            store,
            #[cfg(feature = "_sql")]
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// An `Idem` over a store of your own.
    ///
    /// # Panics
    ///
    /// If the [`hash_keys`](Self::hash_keys) secret is shorter than 16 bytes, or the
    /// [claim limit](Self::limit_new_claims) is shared and the store cannot hold it.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError, store::MemoryStore};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// // A store of your own, or one of idem's wrapped in yours.
    /// let idem = Idem::builder().store(MemoryStore::default());
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub fn store(self, store: impl Store) -> Idem {
        self.try_store(store).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`store`](Self::store), for the openers that answer a `Result`.
    pub(crate) fn try_store(self, store: impl Store) -> Result<Idem, IdemError> {
        self.finish_with(
            Arc::new(store),
            #[cfg(feature = "_sql")]
            None,
        )
    }

    /// The `Idem` over `store`, wrapped in the layer if one was set. `sql` is the same
    /// store when it is a SQL store (for transactional mode, which finds it behind
    /// neither the layer nor the `Store` trait).
    fn finish_with(
        self,
        store: Arc<dyn Store>,
        #[cfg(feature = "_sql")] sql: Option<SqlHandle>,
    ) -> Result<Idem, IdemError> {
        // The openers that return a `Result` refused a bad secret before opening;
        // `memory` and `store` have no other way to.
        self.check_secret()?;
        let store = match &self.layer {
            Some(layer) => (layer.0)(store),
            None => store,
        };
        if self.claim_limit.is_some() {
            store.read_before_claims();
        }
        if let Some(limit) = &self.claim_limit
            && limit.is_shared()
            && !store.shares_claim_counts()
        {
            return Err(IdemError::Config {
                message: "IdemBuilder::limit_new_claims: a shared claim limit needs a store \
                          that can hold the count (PostgreSQL or Redis); drop \
                          `ClaimLimit::shared` to count per process"
                    .into(),
            });
        }
        let cfg = Config {
            max_outcome_bytes: self.max_outcome_bytes,
            max_waiters: self.max_waiters,
            poll_interval: self.poll_interval,
            store_timeout: self.store_timeout,
            renew_leases: self.renew_leases,
            hash_keys: self.hash_keys.clone(),
            fingerprint_key: (self.hash_keys.as_ref())
                .map(|secret| crate::fingerprint::FingerprintKey::new(&secret.0)),
            log_keys_hashed: self.log_keys_hashed,
            #[cfg(feature = "encryption")]
            keyring: self.keyring.clone(),
            claim_limit: (self.claim_limit.clone())
                .map(|limit| Arc::new(crate::limit::ClaimLimiter::new(limit))),
            status_secret: (self.status_secret.clone()).or_else(|| self.hash_keys.clone()),
        };
        Ok(Idem::new(
            store,
            #[cfg(feature = "_sql")]
            sql,
            cfg,
            self.replay_cache_bytes,
        ))
    }

    /// The `hash_keys` secret held to the one rule every store applies
    /// ([`Secret::check`]), before anything is opened.
    pub(crate) fn check_secret(&self) -> Result<(), IdemError> {
        self.hash_keys.as_ref().map_or(Ok(()), Secret::check)?;
        (self.status_secret.as_ref()).map_or(Ok(()), |s| s.check_as("status_secret"))
    }

    /// The SQL stores' options as this builder set them, for the openers of the SQL
    /// backends (`IdemBuilder::sqlite` and the others, each in its folder under `store/`).
    #[cfg(feature = "_sql")]
    pub(crate) fn sql_options(&self) -> Result<SqlOptions, IdemError> {
        let mut opts = SqlOptions::default();
        if let Some(table) = &self.table {
            opts.table = table.clone();
        }
        opts.migrate = self.migrate;
        opts.max_connections = self.max_connections;
        opts.group_commit = self.group_commit;
        self.check_secret()?;
        opts.key_mode = crate::secret::key_mode(self.hash_keys.as_ref());
        opts.root_cert = self.root_cert.clone();
        Ok(opts)
    }

    /// The Redis or Valkey store; see [`Idem::redis`].
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .key_prefix("orders")
    ///     .redis("redis://cache.internal:6379")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub async fn redis(self, url: &str) -> Result<Idem, IdemError> {
        self.check_secret()?;
        let prefix = self.redis_prefix();
        let store = crate::store::redis::RedisStore::connect_answering_within(
            url,
            &prefix,
            self.store_timeout,
            self.root_cert.as_deref(),
        )
        .await
        .map_err(|e| crate::connect::redis_located(e, &[url]))?;
        self.redis_key_mode(&store).await?;
        self.try_store(store)
    }

    /// The store on a Redis Cluster, reached through any of its `nodes`
    /// (`redis://host:port`); otherwise as [`IdemBuilder::redis`].
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .redis_cluster(&["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub async fn redis_cluster(self, nodes: &[&str]) -> Result<Idem, IdemError> {
        self.check_secret()?;
        let prefix = self.redis_prefix();
        let store = crate::store::redis::RedisStore::connect_cluster_answering_within(
            nodes,
            &prefix,
            self.store_timeout,
            self.root_cert.as_deref(),
        )
        .await
        .map_err(|e| crate::connect::redis_located(e, nodes))?;
        self.redis_key_mode(&store).await?;
        self.try_store(store)
    }

    /// Records the key mode under the prefix (or finds the same one there); with
    /// `migrate(false)`, writes nothing and requires a store already opened there.
    #[cfg(feature = "redis")]
    async fn redis_key_mode(
        &self,
        store: &crate::store::redis::RedisStore,
    ) -> Result<(), IdemError> {
        if self.migrate {
            let mode = crate::secret::key_mode(self.hash_keys.as_ref());
            store.check_key_mode(&mode).await
        } else {
            let secret = self.hash_keys.as_ref().map(|s| &*s.0);
            store.check_existing(secret).await
        }
    }

    #[cfg(feature = "redis")]
    fn redis_prefix(&self) -> String {
        self.key_prefix
            .clone()
            .unwrap_or_else(|| crate::store::redis::DEFAULT_PREFIX.to_owned())
    }

    /// A store on the application's own sqlx pool; see [`Idem::from_pool`].
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::BoxError> {
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// let idem = Idem::builder().table("app_idem").pool(pool).await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "_sql")]
    pub async fn pool<P: IntoStore>(self, pool: P) -> Result<Idem, IdemError> {
        let opts = self.sql_options()?;
        let store = DialectOf::<P>::from_pool(pool.into_pool(), &opts).await?;
        self.sql_store(store)
    }

    /// An `Idem` over a SQL store, reachable by transactional mode too.
    #[cfg(feature = "_sql")]
    pub(crate) fn sql_store<D: Dialect>(self, store: SqlStore<D>) -> Result<Idem, IdemError> {
        let store = Arc::new(store);
        self.finish_with(store.clone(), Some(SqlHandle::new(store)))
    }
}

/// A sqlx pool idem can keep its records in: `PgPool`, `MySqlPool` or `SqlitePool`, each
/// with its store's feature.
#[cfg(feature = "_sql")]
pub trait IntoStore: sealed::Sealed {
    /// The pool's database. Not a stable API.
    #[doc(hidden)]
    type Db: SqlDb;

    /// The pool. Not a stable API.
    #[doc(hidden)]
    fn into_pool(self) -> sqlx::Pool<Self::Db>;
}

/// The dialect of `P`'s database.
#[cfg(feature = "_sql")]
type DialectOf<P> = <<P as IntoStore>::Db as SqlDb>::Dialect;

#[cfg(feature = "_sql")]
mod sealed {
    pub trait Sealed {}
}

#[cfg(feature = "_sql")]
impl<DB: SqlDb> sealed::Sealed for sqlx::Pool<DB> {}

/// The pool of each database whose feature is enabled: `PgPool` (`postgres`),
/// `MySqlPool` (`mysql`), `SqlitePool` (`sqlite`).
#[cfg(feature = "_sql")]
impl<DB: SqlDb> IntoStore for sqlx::Pool<DB> {
    type Db = DB;

    fn into_pool(self) -> sqlx::Pool<DB> {
        self
    }
}
