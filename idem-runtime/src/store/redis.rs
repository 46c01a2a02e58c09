//! The store on Redis or Valkey, standalone or Redis Cluster (feature `redis`).
//!
//! ```no_run
//! use idem_runtime::{Idem, IdemError};
//!
//! # async fn open() -> Result<(), IdemError> {
//! let idem = Idem::redis("redis://127.0.0.1:6379").await?; // keys under `idem:`
//! let billing = Idem::builder()
//!     .key_prefix("billing")
//!     .redis_cluster(&["redis://node-1:6379", "redis://node-2:6379"])
//!     .await?;
//! # let _ = (idem, billing); Ok(()) }
//! ```
//!
//! Every state change is one Lua script (`idem-runtime/lua/*.lua`), so the claim's
//! decision (fresh, replay, in flight, mismatch, takeover, or UNKNOWN under
//! [`Takeover::Unknown`]) is one round trip and one atomic
//! step on the server; every write after a claim is fenced on its epoch inside the
//! script. Leases, retention and ages use the server's clock (`TIME`).
//!
//! # Keys
//!
//! An operation `(scope, name, key)` lives in two keys sharing one hash tag, the first
//! 128 bits of a SHA-256 of the three parts, so every script touches one slot in Redis
//! Cluster:
//!
//! - `<prefix>:r:{<tag>}`, a hash: state, epoch, fingerprint, the operation, the
//!   lease, and for a completed record its outcome (one field, `is_err:version:body`)
//!   and retention deadline (`idem-runtime/lua/prelude.lua` lists the fields). A fresh
//!   claim writes its lease's length alone: its epoch is the server's clock in µs, so
//!   the claim time and the lease deadline follow from the two, and the script converts
//!   and formats no number. A renewal or a later claim of the record writes both. A
//!   completed record gets `PEXPIRE` five minutes past its retention: claims treat it
//!   as absent from its retention on, [`Store::purge_expired`] deletes (and counts) the
//!   ones it finds early, and Redis drops the rest by itself, so nothing needs to run a
//!   purge.
//! - `<prefix>:s:{<tag>}`, the operation's [steps](Store::record_step), a hash from
//!   label to `seq:epoch:recorded-at:is_err:version:body` (`seq` numbers the labels
//!   in the order first recorded, so [`Store::steps`] lists them oldest first; a label
//!   recorded again keeps its `seq`). It exists only while its record is in progress or
//!   unknown, and goes in the script that completes, removes or forgets the record, or
//!   that claims or purges it once it expired.
//!
//! Steps belong to one life of the record, which the record's field `st` tracks:
//! absent, no steps in this life (the steps key, if any, is an earlier life's, and the
//! first step recorded deletes it); `1`, the steps key is this life's; `2`, the claim
//! was released with its steps (a release, or an operator's retry): the record stays
//! in progress with its fingerprint and a lapsed lease, its epoch no longer holds, and
//! the next claim with the same fingerprint resumes it at once, until it expires
//! (`xa`, the operation's retention from the release): then it is expired as a
//! completed record is, and it and its steps key get the same `PEXPIRE` five minutes
//! later. A fresh claim, or a
//! claim that replaces an expired record, writes a hash without `st`. An operation that
//! records no steps pays for them with one more field read in its scripts.
//!
//! Beside them, `<prefix>:m:{key-mode}` records how the prefix stores keys and scopes
//! (as given, or keyed-hashed under [`hash_keys`](crate::IdemBuilder::hash_keys) with
//! a check value of the secret). [`IdemBuilder::redis`](crate::IdemBuilder::redis)
//! writes it at the first open (`SET … NX`) and refuses an open in another mode, as the
//! SQL stores do with their table: the other mode would give every operation another
//! identity and run its body again. Its own hash tag keeps it one key on one slot.
//!
//! # Why epochs never repeat
//!
//! An epoch is the server's clock (`TIME`) in microseconds when the claim ran, or the
//! record's epoch plus one if that is higher: a new record takes the clock, and a
//! takeover or a resume takes the larger of the clock and the epoch it replaces. Two
//! claims of one operation are at least a round trip apart (the second needs the
//! first's reply, then a release or a lapsed lease), so each claim's epoch is its own
//! microsecond, later than every earlier claim's. A release or a purge that deletes the
//! record therefore needs no tombstone: the next claim's clock is past every epoch the
//! operation ever had, and a stalled claimant's late write stays fenced. Within one
//! life of the record epochs only grow, whatever the clock does. The one way to see an
//! epoch again is the server's clock stepping back (or a failover to a server whose
//! clock is behind) onto the exact microsecond of an earlier claim of the same
//! operation, deleted since, whose claimant is still running.
//!
//! # Waiters
//!
//! A caller about to wait on an in-flight operation flags its record; finishing a
//! flagged record (record, release, UNKNOWN, resolve) publishes the operation on
//! `<prefix>:wake` in the same script, and each `Idem` subscribes to that channel and
//! wakes its waiters at once. Unflagged records publish nothing. A wake-up lost to a
//! dropped subscription costs one poll interval.
//!
//! # Replays
//!
//! After replays were seen lately (see [`Store::peek_completed`]; each replay raises a
//! score by 8, up to 64, each fresh claim lowers it by 1), a replay is first tried as
//! plain commands in one pipelined round trip, far lighter for the server than a
//! script; what that read does not answer goes on to the claim script. On a standalone
//! server the read is `HMGET` of the record and `TIME`: a COMPLETED record whose
//! retention ends after that `TIME` (read after the record, so the record was unexpired
//! when read) answers the replay or the mismatch. On a cluster, where `TIME` could
//! reach another node's clock, the record's own TTL stands in for the clock: `HMGET`,
//! `PTTL`, `HMGET` on the record's node, answering only when the TTL is above the five
//! minutes a record is kept past its retention and the two reads agree on state, epoch
//! and deadline.
//!
//! # Listing and stats
//!
//! [`Store::stats`], [`Store::list`] and [`Store::purge_expired`] walk the record keys
//! with `SCAN … MATCH <prefix>:r:*` (never `KEYS`), on every master in a cluster: an
//! index (a sorted set per state) would be one more key on another slot, which a
//! cluster script cannot touch together with the record. They cost a pass over the
//! store's keys and are meant for operators and alerting, not for request paths.
//!
//! # No transactional mode
//!
//! Transactional mode ([`Operation::begin_tx`](crate::Operation::begin_tx)) commits the
//! outcome in the same transaction as the caller's own writes. Redis cannot join that
//! transaction: the caller's data lives in another database, and `MULTI` neither spans
//! databases nor rolls back. So transactional mode needs a SQL store; on Redis an
//! operation runs leased, with the claim, the body and the record as separate steps.
//!
//! # Durability
//!
//! The store is as durable as the server is configured to be: with persistence off, a
//! restart forgets completed records and a retry runs its body again; with AOF and
//! `appendfsync everysec`, up to a second of records can be lost; with `appendfsync
//! always` a recorded outcome survives a crash as it does in PostgreSQL. A replica
//! promoted after a failover may miss the last writes (replication is asynchronous,
//! and idem does not issue `WAIT`).
//!
//! # Connections
//!
//! One store (and every clone of its `Idem`) holds, on a standalone server, 3
//! connections: two multiplexed connections for commands (each reconnects by itself
//! after a drop) and one subscribed to the wake-up channel. Scripts take the two in
//! turn, so the server runs one connection's scripts while the client writes the
//! other's; the replay read and other light commands stay on the first, where they
//! gather into fewer writes. On a cluster it holds one
//! multiplexed connection per node, the subscription to the first node, and, while
//! [`Store::stats`], [`Store::list`] or [`Store::purge_expired`] runs, one more per
//! master. The builder's `max_connections` does not apply: commands share their
//! connection rather than wait for one.
//!
//! # Errors
//!
//! A server that cannot be reached is a retryable, unreachable
//! [`IdemError::Store`], the only kind
//! [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) acts on.
//!
//! # A read-only server
//!
//! A replica refuses the scripts' writes with `READONLY` (a URL naming a replica, or a
//! primary demoted in a failover until the client follows the new one). That is a
//! retryable store error, never an unreachable one: the body does not run, and
//! `fail_open` does not run it unprotected either (the server answered and holds the
//! records); a record is retried while its lease holds.

use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{RedisError, Script, ScriptInvocation, Value};
use std::sync::Arc;

use super::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail,
    RecordInfo, ReplayGate, State, Stats, StepRecord, Store, StoreFuture, StoredOutcome, Takeover,
    WakeHub,
};
use crate::error::{IdemError, StoreError};

/// The key prefix when none is set.
pub const DEFAULT_PREFIX: &str = "idem";
/// Longest retention the store keeps (about 100 years), so deadlines stay exact
/// integers in Lua's numbers.
const MAX_RETAIN_MS: u128 = 100 * 365 * 86_400_000;
/// How long one command may take before it counts as a lost connection, on a store
/// connected without a builder; the builder's stores use their store timeout.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// Keys asked for per `SCAN` step.
const SCAN_COUNT: u32 = 1000;
/// How long Redis keeps a completed record past its retention (the prelude's
/// `GRACE_MS`).
const GRACE_MS: i64 = 300_000;

const PRELUDE: &str = include_str!("../../lua/prelude.lua");
const LIFECYCLE: &str = include_str!("../../lua/lifecycle.lua");
/// The line of a script where the lifecycle helpers go, when not at its top.
const LIFECYCLE_AT: &str = "--[[lifecycle]]";

/// The scripts, each with the prelude in front and the lifecycle helpers at its
/// `--[[lifecycle]]` line (or after the prelude).
#[derive(Debug)]
struct Scripts {
    claim: Script,
    record: Script,
    release: Script,
    mark_unknown: Script,
    renew: Script,
    resolve: Script,
    forget: Script,
    record_step: Script,
    steps: Script,
    read: Script,
    purge: Script,
    announce: Script,
}

impl Scripts {
    fn new() -> Scripts {
        let s = |body: &str| {
            let body = match body.split_once(LIFECYCLE_AT) {
                Some((first, rest)) => format!("{first}{LIFECYCLE}{rest}"),
                None => format!("{LIFECYCLE}\n{body}"),
            };
            Script::new(&format!("{PRELUDE}\n{body}"))
        };
        Scripts {
            claim: s(include_str!("../../lua/claim.lua")),
            record: s(include_str!("../../lua/record.lua")),
            release: s(include_str!("../../lua/release.lua")),
            mark_unknown: s(include_str!("../../lua/mark_unknown.lua")),
            renew: s(include_str!("../../lua/renew.lua")),
            resolve: s(include_str!("../../lua/resolve.lua")),
            forget: s(include_str!("../../lua/forget.lua")),
            record_step: s(include_str!("../../lua/record_step.lua")),
            steps: s(include_str!("../../lua/steps.lua")),
            read: s(include_str!("../../lua/read.lua")),
            purge: s(include_str!("../../lua/purge.lua")),
            announce: s(include_str!("../../lua/announce.lua")),
        }
    }
}

/// A connection to a standalone server (reconnecting) or to a cluster.
// One per store, never moved around: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Conn {
    Single(Healing),
    Cluster {
        conn: ClusterConnection,
        /// The first node's connection settings, for the per-node connections of `SCAN`.
        info: Box<::redis::ConnectionInfo>,
    },
}

/// A standalone server's connections ([`CONNECTIONS`]), replaced when one may have gone
/// silent.
///
/// Scripts take the connections in turn: while the server runs the scripts one
/// connection brought, the client writes the next batch on the other, so neither waits
/// on the other. Light commands (the replay read, `GET`, `SCAN`) stay on the first,
/// where they gather into fewer writes: their cost is the client's, not the server's.
///
/// The connection manager reconnects after a connection error, but a half-open
/// connection (a partition, a reply lost on the way with the socket left open) raises
/// none: every later command would wait on it. A command whose caller gave up on it
/// after [`SUSPECT_AFTER`] (or that timed out) marks the connections suspect, and the
/// next command opens fresh ones first.
struct Healing {
    current: std::sync::RwLock<Vec<ConnectionManager>>,
    next: std::sync::atomic::AtomicUsize,
    client: ::redis::Client,
    config: ConnectionManagerConfig,
    suspect: std::sync::atomic::AtomicBool,
}

/// Connections to a standalone server: two let the server run one connection's scripts
/// while the client writes the other's.
const CONNECTIONS: usize = 2;

/// A client for `info`; a `rediss://` server's certificate may also chain to
/// `root_cert` (a PEM CA) when one is given.
fn open_client(
    info: ::redis::ConnectionInfo,
    root_cert: Option<&[u8]>,
) -> ::redis::RedisResult<::redis::Client> {
    #[cfg(feature = "tls-rustls")]
    if matches!(info.addr(), ::redis::ConnectionAddr::TcpTls { .. }) {
        // rustls needs one process-wide crypto provider; ring unless the application
        // installed another.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
    if let Some(pem) = root_cert {
        return ::redis::Client::build_with_tls(
            info,
            ::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.to_vec()),
            },
        );
    }
    let _ = root_cert;
    ::redis::Client::open(info)
}

/// Opens [`CONNECTIONS`] connections.
async fn connections(
    client: &::redis::Client,
    config: &ConnectionManagerConfig,
) -> Result<Vec<ConnectionManager>, RedisError> {
    let mut all = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        all.push(ConnectionManager::new_with_config(client.clone(), config.clone()).await?);
    }
    Ok(all)
}

/// Which of a standalone server's connections a command takes.
#[derive(Clone, Copy)]
enum Lane {
    /// The first: plain commands (the replay read, `GET`, `SET`, `SCAN`), which gather
    /// there into fewer writes.
    Light,
    /// The next in turn: scripts, the server's work.
    Script,
}

/// A command pending this long when its caller gives up is not a slow reply: Redis
/// answers in microseconds.
const SUSPECT_AFTER: Duration = Duration::from_millis(500);

impl Healing {
    /// The connection for the next command on `lane` (fresh ones if the last command
    /// left them suspect).
    async fn get(&self, lane: Lane) -> Result<ConnectionManager, RedisError> {
        if self
            .suspect
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            tracing::warn!("replacing a Redis connection that stopped answering");
            // Suspect again unless replaced: a caller that gives up while the fresh
            // connections open leaves the replacement to the next command.
            let replacing = StillSuspect(Some(&self.suspect));
            let fresh = connections(&self.client, &self.config).await?;
            replacing.disarm();
            *self.current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        }
        let all = self.current.read().unwrap_or_else(|p| p.into_inner());
        let i = match lane {
            Lane::Light => 0,
            Lane::Script => {
                self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % all.len()
            }
        };
        Ok(all[i].clone())
    }

    /// Runs `command` on `lane`, marking the connections suspect if it times out or its
    /// caller gives up on it after [`SUSPECT_AFTER`].
    async fn run<T>(
        &self,
        lane: Lane,
        command: impl AsyncFnOnce(&mut ConnectionManager) -> Result<T, RedisError>,
    ) -> Result<T, RedisError> {
        let mut conn = self.get(lane).await?;
        let watch = Watch {
            healing: self,
            since: std::time::Instant::now(),
            done: false,
        };
        let out = command(&mut conn).await;
        let mut watch = watch;
        watch.done = true;
        if out.as_ref().is_err_and(|e| e.is_timeout()) {
            self.suspect
                .store(true, std::sync::atomic::Ordering::Release);
        }
        out
    }
}

/// Marks the connections suspect again when dropped armed: their replacement did not
/// finish.
struct StillSuspect<'a>(Option<&'a std::sync::atomic::AtomicBool>);

impl StillSuspect<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for StillSuspect<'_> {
    fn drop(&mut self) {
        if let Some(suspect) = self.0 {
            suspect.store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

/// Marks the connection suspect when dropped unfinished after [`SUSPECT_AFTER`].
struct Watch<'a> {
    healing: &'a Healing,
    since: std::time::Instant,
    done: bool,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        if !self.done && self.since.elapsed() >= SUSPECT_AFTER {
            self.healing
                .suspect
                .store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

/// The store on Redis or Valkey; see the [module docs](self).
///
/// Opened by [`Idem::redis`](crate::Idem::redis) and
/// [`IdemBuilder::redis`](crate::IdemBuilder::redis), or by [`RedisStore::connect`]
/// for use with [`IdemBuilder::store`](crate::IdemBuilder::store).
pub struct RedisStore {
    conn: Conn,
    prefix: String,
    scripts: Scripts,
    /// Where the wake-up subscription connects (a standalone server, or a cluster's
    /// first node: `PUBLISH` reaches every node of a cluster).
    pubsub: ::redis::Client,
    /// The task relaying wake-ups to this process's waiters, ended with the store.
    listener: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
    /// Whether replays came in lately, so a replay is worth reading before the claim.
    gate: ReplayGate,
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        let listener = self.listener.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(task) = listener.take() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("cluster", &matches!(self.conn, Conn::Cluster { .. }))
            .finish()
    }
}

fn check_prefix(prefix: &str) -> Result<(), IdemError> {
    // A brace in the prefix would become the key's hash tag and put every operation
    // on one slot (or split one operation's keys across slots).
    if prefix.is_empty() || prefix.contains(['{', '}']) {
        return Err(IdemError::Config {
            message: format!(
                "the Redis key prefix {prefix:?} must be non-empty and free of braces"
            ),
        });
    }
    Ok(())
}

fn config_error(what: &str, e: RedisError) -> IdemError {
    IdemError::Config {
        message: format!("{what}: {e}"),
    }
}

impl RedisStore {
    /// Connects to a standalone Redis or Valkey server (`redis://…`, `rediss://…` with
    /// TLS support compiled into the `redis` crate), keeping records under `prefix`.
    /// The connection reconnects by itself after a drop.
    ///
    /// A store connected here and passed to [`IdemBuilder::store`](crate::IdemBuilder::store)
    /// is used as it is: the prefix's key mode is neither recorded nor checked against
    /// the builder's [`hash_keys`](crate::IdemBuilder::hash_keys). Open with
    /// [`IdemBuilder::redis`](crate::IdemBuilder::redis) to have it checked. A command
    /// unanswered for 30 s counts as a lost connection (the builder's stores use their
    /// [`store_timeout`](crate::IdemBuilder::store_timeout) instead).
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisStore, IdemError> {
        Self::connect_answering_within(url, prefix, RESPONSE_TIMEOUT, None).await
    }

    /// [`connect`](Self::connect), where a command unanswered for `response_timeout`
    /// counts as a lost connection, which is then replaced, and a `rediss://` server's
    /// certificate may chain to `root_cert` (a PEM CA).
    pub(crate) async fn connect_answering_within(
        url: &str,
        prefix: &str,
        response_timeout: Duration,
        root_cert: Option<&[u8]>,
    ) -> Result<RedisStore, IdemError> {
        use ::redis::IntoConnectionInfo;
        check_prefix(prefix)?;
        let info = url
            .into_connection_info()
            .map_err(|e| config_error("invalid Redis URL", e))?;
        let client =
            open_client(info, root_cert).map_err(|e| config_error("invalid Redis URL", e))?;
        // Few, short reconnect attempts: a caller learns soon that the server is gone
        // (and `fail_open` can act); the next call tries again.
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500))
            .set_response_timeout(Some(response_timeout))
            .set_connection_timeout(Some(Duration::from_secs(5)));
        let managers = connections(&client, &config).await.map_err(connect_error)?;
        let healing = Healing {
            current: std::sync::RwLock::new(managers),
            next: Default::default(),
            client: client.clone(),
            config,
            suspect: Default::default(),
        };
        Ok(RedisStore {
            conn: Conn::Single(healing),
            prefix: prefix.to_owned(),
            scripts: Scripts::new(),
            pubsub: client,
            listener: Default::default(),
            gate: ReplayGate::default(),
        })
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port`),
    /// keeping records under `prefix`. As with [`connect`](Self::connect), the key mode
    /// is checked only when opened through
    /// [`IdemBuilder::redis_cluster`](crate::IdemBuilder::redis_cluster).
    pub async fn connect_cluster(nodes: &[&str], prefix: &str) -> Result<RedisStore, IdemError> {
        Self::connect_cluster_answering_within(nodes, prefix, RESPONSE_TIMEOUT, None).await
    }

    /// [`connect_cluster`](Self::connect_cluster), where a command unanswered for
    /// `response_timeout` counts as a lost connection, and `rediss://` nodes'
    /// certificates may chain to `root_cert` (a PEM CA).
    pub(crate) async fn connect_cluster_answering_within(
        nodes: &[&str],
        prefix: &str,
        response_timeout: Duration,
        root_cert: Option<&[u8]>,
    ) -> Result<RedisStore, IdemError> {
        use ::redis::IntoConnectionInfo;
        check_prefix(prefix)?;
        let first = nodes.first().ok_or_else(|| IdemError::Config {
            message: "a Redis Cluster needs at least one node URL".into(),
        })?;
        let info = first
            .into_connection_info()
            .map_err(|e| config_error("invalid Redis URL", e))?;
        let builder = ::redis::cluster::ClusterClientBuilder::new(nodes.to_vec())
            .response_timeout(response_timeout)
            .connection_timeout(Duration::from_secs(5));
        #[cfg(feature = "tls-rustls")]
        let builder = match root_cert {
            Some(pem) => builder.certs(::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.to_vec()),
            }),
            None => builder,
        };
        let client = builder
            .build()
            .map_err(|e| config_error("invalid Redis Cluster nodes", e))?;
        let conn = client.get_async_connection().await.map_err(connect_error)?;
        let pubsub =
            open_client(info, root_cert).map_err(|e| config_error("invalid Redis URL", e))?;
        // The nodes' address form (and a TLS one's certificates) as the client holds it.
        let info = pubsub.get_connection_info().clone();
        Ok(RedisStore {
            conn: Conn::Cluster {
                conn,
                info: Box::new(info),
            },
            prefix: prefix.to_owned(),
            scripts: Scripts::new(),
            pubsub,
            listener: Default::default(),
            gate: ReplayGate::default(),
        })
    }

    /// Records `wanted` as the prefix's key mode if it has none yet, and fails with a
    /// [`IdemError::Config`] naming both modes if it has another.
    pub(crate) async fn check_key_mode(&self, wanted: &str) -> Result<(), IdemError> {
        let key = format!("{}:m:{{key-mode}}", self.prefix);
        let failed = |e: RedisError| IdemError::store("open", store_error(e));
        let mut set = ::redis::cmd("SET");
        set.arg(&key).arg(wanted).arg("NX");
        let mut get = ::redis::cmd("GET");
        get.arg(&key);
        // Written once and never changed, so reading it after a refused `SET NX` reads
        // what the first open wrote.
        let recorded: Option<String> = match &self.conn {
            Conn::Single(c) => {
                let written: Option<String> = c
                    .run(Lane::Light, async |c| set.query_async(c).await)
                    .await
                    .map_err(failed)?;
                match written {
                    Some(_) => None,
                    None => c
                        .run(Lane::Light, async |c| get.query_async(c).await)
                        .await
                        .map_err(failed)?,
                }
            }
            Conn::Cluster { conn, .. } => {
                let written: Option<String> =
                    set.query_async(&mut conn.clone()).await.map_err(failed)?;
                match written {
                    Some(_) => None,
                    None => get.query_async(&mut conn.clone()).await.map_err(failed)?,
                }
            }
        };
        crate::secret::check_key_mode(
            &format!("the Redis key prefix `{}`", self.prefix),
            "another prefix (`IdemBuilder::key_prefix`)",
            recorded.as_deref(),
            wanted,
        )
    }

    /// Checks, without writing anything, that an application opened an idem store under
    /// this prefix (with [`IdemBuilder::redis`](crate::IdemBuilder::redis) or
    /// [`redis_cluster`](crate::IdemBuilder::redis_cluster), which record how its keys
    /// are stored) and that it stores keys as `hash_keys` says: the secret the application
    /// gives [`IdemBuilder::hash_keys`](crate::IdemBuilder::hash_keys), or `None`.
    ///
    /// For tools that must not create a store where there is none, such as the `idem`
    /// command: a wrong URL or prefix is then an error rather than an empty store, and a
    /// missing or wrong secret an error rather than "no such record".
    pub async fn check_existing(&self, hash_keys: Option<&[u8]>) -> Result<(), IdemError> {
        let secret = hash_keys.map(|s| crate::secret::Secret(Arc::from(s)));
        if let Some(secret) = &secret {
            secret.check()?;
        }
        let key = format!("{}:m:{{key-mode}}", self.prefix);
        let mut get = ::redis::cmd("GET");
        get.arg(&key);
        let failed = |e: RedisError| IdemError::store("open", store_error(e));
        let recorded: Option<String> = match &self.conn {
            Conn::Single(c) => c
                .run(Lane::Light, async |c| get.query_async(c).await)
                .await
                .map_err(failed)?,
            Conn::Cluster { conn, .. } => {
                get.query_async(&mut conn.clone()).await.map_err(failed)?
            }
        };
        let Some(recorded) = recorded else {
            return Err(IdemError::Config {
                message: format!(
                    "no idem store under the Redis key prefix `{}` on this server (its key \
                     `{key}` is missing: no application opened one there); check the prefix \
                     the application gives `IdemBuilder::key_prefix` and the URL",
                    self.prefix
                ),
            });
        };
        crate::secret::check_key_mode(
            &format!("the Redis key prefix `{}`", self.prefix),
            "another prefix",
            Some(&recorded),
            &crate::secret::key_mode(secret.as_ref()),
        )
    }

    /// The record key and the steps key of `id`.
    fn keys(&self, id: &OperationId) -> (String, String) {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [&id.scope, &id.name, &id.key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let mut rec = String::with_capacity(self.prefix.len() + 37);
        rec.push_str(&self.prefix);
        rec.push_str(":r:{");
        crate::secret::push_hex(&mut rec, &h.finalize()[..16]);
        rec.push('}');
        // The steps key differs from the record key in the kind's letter alone.
        let kind = self.prefix.len() + 1;
        let mut steps = rec.clone();
        steps.replace_range(kind..kind + 1, "s");
        (rec, steps)
    }

    /// The steps key beside the record key `rec`, as [`keys`](Self::keys) makes both.
    fn steps_key_of(&self, rec: &[u8]) -> Vec<u8> {
        let mut steps = rec.to_vec();
        steps[self.prefix.len() + 1] = b's';
        steps
    }

    /// Whether `key` is one of this store's record keys (and not one of a store whose
    /// prefix merely starts with ours).
    fn is_record_key(&self, key: &[u8]) -> bool {
        let head = format!("{}:r:{{", self.prefix);
        key.len() == head.len() + 33 && key.starts_with(head.as_bytes()) && key.ends_with(b"}")
    }

    /// Runs `script` on `id`'s keys with `args`.
    async fn run(
        &self,
        script: &Script,
        id: &OperationId,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let (rec, steps) = self.keys(id);
        let mut inv = script.prepare_invoke();
        inv.key(rec).key(steps);
        for a in args {
            inv.arg(*a);
        }
        self.invoke(&inv).await
    }

    async fn invoke(&self, inv: &ScriptInvocation<'_>) -> Result<Value, StoreError> {
        match &self.conn {
            Conn::Single(c) => {
                c.run(Lane::Script, async |c| inv.invoke_async(c).await)
                    .await
            }
            Conn::Cluster { conn, .. } => inv.invoke_async(&mut conn.clone()).await,
        }
        .map_err(store_error)
    }

    /// A fenced write: 1 from the script means the epoch held.
    async fn fenced(
        &self,
        script: &Script,
        id: &OperationId,
        args: &[&[u8]],
    ) -> Result<Fence, StoreError> {
        let v = self.run(script, id, args).await?;
        Ok(match int(&v) {
            Some(1) => Fence::Held,
            Some(0) => Fence::Lost,
            _ => return Err(protocol(format!("a fenced write answered {v:?}"))),
        })
    }

    /// Every record of this store on every node, with the node's clock.
    async fn scan(&self) -> Result<Vec<(u64, Row)>, StoreError> {
        let mut rows = Vec::new();
        match &self.conn {
            Conn::Single(c) => {
                let mut c = c.get(Lane::Light).await.map_err(store_error)?;
                self.scan_node(&mut c, &mut rows).await?
            }
            Conn::Cluster { conn, info } => {
                for (host, port) in masters(&mut conn.clone()).await? {
                    let addr = match info.addr() {
                        ::redis::ConnectionAddr::TcpTls {
                            insecure,
                            tls_params,
                            ..
                        } => ::redis::ConnectionAddr::TcpTls {
                            host,
                            port,
                            insecure: *insecure,
                            tls_params: tls_params.clone(),
                        },
                        _ => ::redis::ConnectionAddr::Tcp(host, port),
                    };
                    let node = (**info).clone().set_addr(addr);
                    let client = ::redis::Client::open(node).map_err(store_error)?;
                    let mut c = client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(store_error)?;
                    self.scan_node(&mut c, &mut rows).await?;
                }
            }
        }
        Ok(rows)
    }

    async fn scan_node<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        rows: &mut Vec<(u64, Row)>,
    ) -> Result<(), StoreError> {
        let (secs, micros): (u64, u64) = ::redis::cmd("TIME")
            .query_async(conn)
            .await
            .map_err(store_error)?;
        let now = secs * 1000 + micros / 1000;
        let pattern = format!("{}:r:{{*", glob_escape(&self.prefix));
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(conn)
                .await
                .map_err(store_error)?;
            let keys: Vec<Vec<u8>> = keys.into_iter().filter(|k| self.is_record_key(k)).collect();
            if !keys.is_empty() {
                let mut pipe = ::redis::pipe();
                for k in &keys {
                    pipe.cmd("HMGET")
                        .arg(k)
                        .arg(&["s", "e", "ca", "sn", "k", "xa", "st"]);
                }
                let fields: Vec<Vec<Option<Vec<u8>>>> =
                    pipe.query_async(conn).await.map_err(store_error)?;
                for (key, f) in keys.into_iter().zip(fields) {
                    if let Some(row) = Row::parse(key, &f) {
                        rows.push((now, row));
                    }
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(());
            }
        }
    }
}

/// Relays the wake-ups published on `channel` to `hub`, reconnecting after a drop (a
/// wake-up missed meanwhile costs its waiters one poll interval).
async fn relay_wakeups(client: ::redis::Client, channel: String, hub: Arc<WakeHub>) {
    use futures_util::StreamExt;
    loop {
        if let Ok(mut pubsub) = client.get_async_pubsub().await
            && pubsub.subscribe(&channel).await.is_ok()
        {
            let mut messages = pubsub.into_on_message();
            while let Some(msg) = messages.next().await {
                if let Some(id) = parse_wakeup(msg.get_payload_bytes()) {
                    hub.wake(&id);
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `<len>:<scope><len>:<name><key>`, as `wake()` in lifecycle.lua publishes it.
fn parse_wakeup(mut b: &[u8]) -> Option<OperationId> {
    let mut part = || {
        let colon = b.iter().position(|&c| c == b':')?;
        let len: usize = std::str::from_utf8(&b[..colon]).ok()?.parse().ok()?;
        let text = b.get(colon + 1..colon + 1 + len)?;
        let text = String::from_utf8(text.to_vec()).ok()?;
        b = &b[colon + 1 + len..];
        Some(text)
    };
    let scope = part()?;
    let name = part()?;
    Some(OperationId {
        scope,
        name,
        key: String::from_utf8(b.to_vec()).ok()?,
    })
}

/// A step as `record_step.lua` packs it: `seq:epoch:at:` and its outcome as
/// [`packed`] writes it.
struct PackedStep {
    /// Its place among the operation's steps, from 1.
    seq: u64,
    epoch: u64,
    /// When it was recorded, by the server's clock (ms).
    at: i64,
    outcome: StoredOutcome,
}

impl PackedStep {
    fn parse(packed: &[u8]) -> Option<PackedStep> {
        let mut parts = packed.splitn(4, |&b| b == b':');
        let mut num = || std::str::from_utf8(parts.next()?).ok();
        let (seq, epoch, at) = (num()?, num()?, num()?);
        Some(PackedStep {
            seq: seq.parse().ok()?,
            epoch: epoch.parse().ok()?,
            at: at.parse().ok()?,
            outcome: unpack(parts.next()?)?,
        })
    }

    /// The step as the store's contract gives it, its age by the server's `now`.
    fn record(self, label: String, now: i64) -> StepRecord {
        StepRecord {
            label,
            epoch: self.epoch,
            age: Duration::from_millis(now.saturating_sub(self.at).max(0) as u64),
            outcome: self.outcome,
        }
    }
}

/// A record as `SCAN` sees it.
struct Row {
    key: Vec<u8>,
    state: State,
    epoch: u64,
    claimed_at: u64,
    expires_at: Option<u64>,
    /// In progress, released with its steps kept (`st` is '2'): no claim holds it.
    released: bool,
    id: OperationId,
}

impl Row {
    /// `None` for a key that went away between `SCAN` and `HMGET`.
    fn parse(key: Vec<u8>, f: &[Option<Vec<u8>>]) -> Option<Row> {
        let text = |i: usize| {
            f.get(i)
                .and_then(|v| v.as_deref())
                .map(|b| String::from_utf8_lossy(b).into_owned())
        };
        let num = |i: usize| text(i).and_then(|s| s.parse::<u64>().ok());
        // `sn` and `k` together are the operation as a wake-up carries it.
        let mut op = f.get(3)?.clone()?;
        op.extend_from_slice(f.get(4)?.as_deref()?);
        let epoch = num(1)?;
        Some(Row {
            key,
            state: State::from_code(num(0)? as i64)?,
            epoch,
            // A record as its first claim wrote it has no `ca`: its epoch is the
            // server's clock in µs at that claim (prelude.lua).
            claimed_at: num(2).unwrap_or(epoch / 1000),
            expires_at: num(5),
            released: num(6) == Some(2),
            id: parse_wakeup(&op)?,
        })
    }

    fn age(&self, now: u64) -> Duration {
        Duration::from_millis(now.saturating_sub(self.claimed_at))
    }
}

/// The masters of a cluster, from `CLUSTER SLOTS`.
async fn masters(conn: &mut ClusterConnection) -> Result<Vec<(String, u16)>, StoreError> {
    let v: Value = ::redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(store_error)?;
    let mut out = Vec::new();
    let Value::Array(ranges) = v else {
        return Err(protocol(format!("CLUSTER SLOTS answered {v:?}")));
    };
    for range in ranges {
        let Value::Array(parts) = range else { continue };
        let Some(Value::Array(master)) = parts.get(2) else {
            continue;
        };
        let host = master.first().and_then(text);
        let port = master.get(1).and_then(int);
        if let (Some(host), Some(port)) = (host, port) {
            let node = (host, port as u16);
            if !out.contains(&node) {
                out.push(node);
            }
        }
    }
    Ok(out)
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A failed first connection; a refused TLS handshake says what to change.
fn connect_error(e: RedisError) -> IdemError {
    let text = e.to_string();
    if !text.contains("certificate") {
        return IdemError::store("connect", store_error(e));
    }
    let hint = format!(
        "the TLS handshake failed: {text}; check that the server's certificate chains to a \
         CA this process trusts (give a private CA with `IdemBuilder::tls_root_certificate`) \
         and names the host the URL gives"
    );
    IdemError::store("connect", StoreError::new(false, hint))
}

/// Connection-level failures are unreachable (and retryable); cluster redirections, a
/// server still loading, and a replica refusing writes (`READONLY`: a failover in
/// progress, or a URL naming a replica) are retryable but answered, so `fail_open`
/// does not run a body on them; anything else is a refusal.
fn store_error(e: RedisError) -> StoreError {
    use ::redis::{ErrorKind, ServerErrorKind};
    if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout() {
        return StoreError::unreachable(e);
    }
    let retryable = e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
        );
    StoreError::new(retryable, e)
}

fn protocol(message: String) -> StoreError {
    StoreError::new(false, format!("unexpected reply from Redis: {message}"))
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

fn ms(d: Duration) -> String {
    d.as_millis().min(MAX_RETAIN_MS).to_string()
}

/// An outcome as the record's field `o` and the end of a packed step hold it:
/// `is_err:version:body`.
fn packed(outcome: &StoredOutcome) -> Vec<u8> {
    let head = format!("{}:{}:", u8::from(outcome.is_err), outcome.version);
    let mut out = Vec::with_capacity(head.len() + outcome.body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(&outcome.body);
    out
}

/// The outcome [`packed`] wrote.
fn unpack(b: &[u8]) -> Option<StoredOutcome> {
    let mut parts = b.splitn(3, |&c| c == b':');
    let (is_err, version, body) = (parts.next()?, parts.next()?, parts.next()?);
    let is_err = match is_err {
        b"0" => false,
        b"1" => true,
        _ => return None,
    };
    Some(StoredOutcome {
        is_err,
        version: std::str::from_utf8(version).ok()?.parse().ok()?,
        body: body.to_vec().into(),
    })
}

/// The outcome a record's field `o` holds.
fn unpacked(v: &Value) -> Result<StoredOutcome, StoreError> {
    match v {
        Value::BulkString(b) => unpack(b),
        _ => None,
    }
    .ok_or_else(|| protocol(format!("a completed record's outcome is {v:?}")))
}

/// A record as `read.lua` returns it, with the server's time.
struct Read {
    now: u64,
    fields: Vec<Value>,
}

impl Read {
    fn exists(&self) -> bool {
        !self.fields.is_empty()
    }
    fn num(&self, i: usize) -> Option<u64> {
        self.fields
            .get(i)
            .and_then(int)
            .and_then(|n| u64::try_from(n).ok())
    }
    fn state(&self) -> Option<State> {
        State::from_code(self.num(0)? as i64)
    }
    fn outcome(&self) -> Option<StoredOutcome> {
        unpacked(self.fields.get(5)?).ok()
    }
}

/// The fields `read.lua` answers: `s`, `e`, `lu`, `ca`, `xa`, `o`.
const FIELDS: usize = 6;

impl RedisStore {
    async fn read(&self, id: &OperationId) -> Result<Read, StoreError> {
        let v = self.run(&self.scripts.read, id, &[]).await?;
        let Value::Array(mut parts) = v else {
            return Err(protocol(format!("read answered {v:?}")));
        };
        if parts.is_empty() {
            return Err(protocol("read answered nothing".into()));
        }
        let fields = parts.split_off(1);
        let now = int(&parts[0])
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| protocol("read gave no time".into()))?;
        if !fields.is_empty() && fields.len() != FIELDS {
            return Err(protocol(format!("read gave {} fields", fields.len())));
        }
        Ok(Read { now, fields })
    }
}

impl Store for RedisStore {
    /// While replays come in, a pipeline of plain commands instead of the claim's script:
    /// far less work for the server. It answers only for a COMPLETED record it knows was
    /// within its retention when read; anything else goes on to the claim.
    ///
    /// - Standalone: `HMGET`, then `TIME`. Not atomic, and it need not be: `TIME` runs
    ///   after the read, so a retention deadline past that time was not reached when the
    ///   record was read.
    /// - Cluster: `TIME` could reach another node and its clock, so the record's own TTL
    ///   stands in for it: `HMGET`, `PTTL`, `HMGET` on the record's node. A completed
    ///   record's TTL ends `GRACE_MS` after its retention, so a TTL above that (by a
    ///   millisecond's rounding) means the retention had not ended; the two reads agreeing
    ///   on state, epoch and deadline mean the TTL was that record's (a new claim always
    ///   takes a new epoch).
    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        StoreFuture::new(async move {
            if !self.gate.open() {
                return Ok(None);
            }
            let (rec, ..) = self.keys(id);
            let read = ["s", "xa", "e", "fp", "o"];
            let (fields, alive) = match &self.conn {
                Conn::Single(conn) => {
                    let mut pipe = ::redis::pipe();
                    pipe.cmd("HMGET").arg(&rec).arg(&read).cmd("TIME");
                    let (fields, (secs, micros)): (Vec<Value>, (i64, i64)) = conn
                        .run(Lane::Light, async |c| pipe.query_async(c).await)
                        .await
                        .map_err(store_error)?;
                    let now = secs * 1000 + micros / 1000;
                    let alive = fields.get(1).and_then(int).is_some_and(|xa| xa > now);
                    (fields, alive)
                }
                Conn::Cluster { conn, .. } => {
                    let (fields, ttl, again): (Vec<Value>, i64, Vec<Value>) = ::redis::pipe()
                        .cmd("HMGET")
                        .arg(&rec)
                        .arg(&read)
                        .cmd("PTTL")
                        .arg(&rec)
                        .cmd("HMGET")
                        .arg(&rec)
                        .arg(&read[..3])
                        .query_async(&mut conn.clone())
                        .await
                        .map_err(store_error)?;
                    let alive = fields.get(..3) == Some(&again[..]) && ttl > GRACE_MS + 1;
                    (fields, alive)
                }
            };
            let [state, _, _, fp, outcome] = &fields[..] else {
                return Err(protocol(format!("HMGET answered {fields:?}")));
            };
            if int(state) != Some(1) || !alive {
                return Ok(None);
            }
            self.gate.saw(true);
            if bytes(fp).as_deref() != Some(&fingerprint[..]) {
                return Ok(Some(Err(Mismatched)));
            }
            unpacked(outcome).map(|o| Some(Ok(o)))
        })
    }

    fn claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
    ) -> StoreFuture<'a, Result<Claim, StoreError>> {
        StoreFuture::new(async move {
            let mode: &[u8] = match req.on_takeover {
                Takeover::Rerun => b"rerun",
                Takeover::Unknown => b"unknown",
            };
            let lease = ms(super::lease_written(req.lease));
            let (scope, name) = (&req.id.scope, &req.id.name);
            let scope_name = format!("{}:{scope}{}:{name}", scope.len(), name.len());
            let v = self
                .run(
                    &self.scripts.claim,
                    req.id,
                    &[
                        &req.fingerprint,
                        lease.as_bytes(),
                        mode,
                        scope_name.as_bytes(),
                        req.id.key.as_bytes(),
                    ],
                )
                .await?;
            let bad = || protocol(format!("claim answered {v:?}"));
            // A fresh claim answers its epoch alone, in decimal.
            if let Value::BulkString(_) = &v {
                self.gate.saw(false);
                return Ok(Claim::Acquired {
                    epoch: int(&v)
                        .and_then(|e| u64::try_from(e).ok())
                        .ok_or_else(bad)?,
                    takeover: false,
                    resume: false,
                });
            }
            let Value::Array(parts) = &v else {
                return Err(bad());
            };
            let tag = parts.first().and_then(text).ok_or_else(bad)?;
            let n = |i: usize| parts.get(i).and_then(int).ok_or_else(bad);
            let claim = match tag.as_str() {
                "acquired" => Claim::Acquired {
                    epoch: n(1)? as u64,
                    takeover: n(2)? == 1,
                    resume: n(3)? == 1,
                },
                "completed" => Claim::Completed(unpacked(parts.get(1).ok_or_else(bad)?)?),
                "inflight" => Claim::InFlight {
                    retry_after: Duration::from_millis(n(1)?.max(0) as u64),
                },
                "mismatch" => Claim::Mismatch,
                "unknown" => Claim::Unknown {
                    epoch: n(1)? as u64,
                    now: n(2)? == 1,
                },
                _ => return Err(bad()),
            };
            self.gate
                .saw(matches!(claim, Claim::Completed(_) | Claim::Mismatch));
            Ok(claim)
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let (epoch, retain) = (epoch.to_string(), ms(retain));
            self.fenced(
                &self.scripts.record,
                id,
                &[epoch.as_bytes(), &packed(outcome), retain.as_bytes()],
            )
            .await
        })
    }

    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let (epoch, retain) = (epoch.to_string(), ms(retain));
            self.fenced(
                &self.scripts.release,
                id,
                &[epoch.as_bytes(), retain.as_bytes()],
            )
            .await
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let epoch = epoch.to_string();
            self.fenced(&self.scripts.mark_unknown, id, &[epoch.as_bytes()])
                .await
        })
    }

    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let (epoch, lease) = (epoch.to_string(), ms(super::lease_written(lease)));
            self.fenced(
                &self.scripts.renew,
                id,
                &[epoch.as_bytes(), lease.as_bytes()],
            )
            .await
        })
    }

    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let epoch = epoch.to_string();
            self.fenced(
                &self.scripts.record_step,
                id,
                &[epoch.as_bytes(), label.as_bytes(), &packed(outcome)],
            )
            .await
        })
    }

    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        StoreFuture::new(async move {
            let v = self.run(&self.scripts.steps, id, &[]).await?;
            let bad = || protocol(format!("steps answered {v:?}"));
            let Value::Array(parts) = &v else {
                return Err(bad());
            };
            let (Some(now), pairs) = (parts.first().and_then(int), parts.get(1..).unwrap_or(&[]))
            else {
                return Err(bad());
            };
            if pairs.len() % 2 != 0 {
                return Err(bad());
            }
            let mut steps = Vec::with_capacity(pairs.len() / 2);
            for pair in pairs.chunks_exact(2) {
                let label = text(&pair[0]).ok_or_else(bad)?;
                let packed = bytes(&pair[1]).ok_or_else(bad)?;
                let step = PackedStep::parse(&packed)
                    .ok_or_else(|| protocol(format!("step {label:?} is stored as {packed:?}")))?;
                steps.push((step.seq, step.record(label, now)));
            }
            steps.sort_by_key(|(seq, _)| *seq);
            Ok(steps.into_iter().map(|(_, step)| step).collect())
        })
    }

    fn announce_wait<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<(), StoreError>> {
        StoreFuture::new(async move { self.run(&self.scripts.announce, id, &[]).await.map(drop) })
    }

    fn attach_wakers(&self, hub: Arc<WakeHub>) {
        // Without a runtime here there is no task to relay wake-ups; waiters then poll.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let channel = format!("{}:wake", self.prefix);
        let task = rt.spawn(relay_wakeups(self.pubsub.clone(), channel, hub));
        let mut listener = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = listener.replace(task.abort_handle()) {
            old.abort();
        }
    }
}

#[async_trait::async_trait]
impl Admin for RedisStore {
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        let epoch = epoch.to_string();
        match completed {
            None => {
                let window = ms(super::RESUME_WINDOW);
                self.fenced(
                    &self.scripts.resolve,
                    id,
                    &[epoch.as_bytes(), b"retry", b"", window.as_bytes()],
                )
                .await
            }
            Some((outcome, retain)) => {
                let retain = ms(retain);
                self.fenced(
                    &self.scripts.resolve,
                    id,
                    &[
                        epoch.as_bytes(),
                        b"complete",
                        &packed(outcome),
                        retain.as_bytes(),
                    ],
                )
                .await
            }
        }
    }

    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        let epoch = epoch.to_string();
        self.fenced(&self.scripts.forget, id, &[epoch.as_bytes()])
            .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut purged = 0;
        for (now, row) in self.scan().await? {
            let ends = row.state == State::Completed || row.released;
            if ends && row.expires_at.is_some_and(|xa| xa <= now) {
                // The script checks again: the record may have been claimed afresh since.
                // A released record's steps go with it.
                let mut inv = self.scripts.purge.prepare_invoke();
                inv.key(&row.key[..]).key(self.steps_key_of(&row.key));
                if int(&self.invoke(&inv).await?) == Some(1) {
                    purged += 1;
                }
            }
        }
        Ok(purged)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut s = Stats::default();
        for (now, row) in self.scan().await? {
            let age = row.age(now);
            s.count(row.state, row.released, age);
        }
        Ok(s)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let mut rows: Vec<RecordInfo> = self
            .scan()
            .await?
            .into_iter()
            .filter(|(now, r)| {
                filter.state.is_none_or(|s| s == r.state)
                    && filter.name.as_deref().is_none_or(|n| n == r.id.name)
                    && filter.scope.as_deref().is_none_or(|s| s == r.id.scope)
                    && filter.older_than.is_none_or(|a| r.age(*now) > a)
                    && filter.newer_than.is_none_or(|a| r.age(*now) <= a)
            })
            .map(|(now, r)| RecordInfo {
                age: r.age(now),
                id: r.id,
                state: r.state,
                epoch: r.epoch,
            })
            .collect();
        super::sort_listed(&mut rows, filter);
        Ok(rows)
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let r = self.read(id).await?;
        if !r.exists() {
            return Ok(None);
        }
        let bad = || protocol("a record without state, epoch or claim time".into());
        let state = r.state().ok_or_else(bad)?;
        let since = |t: Option<u64>| Duration::from_millis(t.unwrap_or(0).saturating_sub(r.now));
        Ok(Some(RecordDetail {
            info: RecordInfo {
                id: id.clone(),
                state,
                epoch: r.num(1).ok_or_else(bad)?,
                age: Duration::from_millis(r.now.saturating_sub(r.num(3).ok_or_else(bad)?)),
            },
            lease_remaining: (state == State::InProgress).then(|| since(r.num(2))),
            // Of the records in progress, only one released with its steps has `xa`.
            expires_in: match state {
                State::Completed => Some(since(r.num(4))),
                State::InProgress => r.num(4).map(|xa| since(Some(xa))),
                _ => None,
            },
            outcome: if state == State::Completed {
                r.outcome()
            } else {
                None
            },
            steps: Vec::new(),
        }))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_grace_period_is_the_scripts_own() {
        let line = format!("local GRACE_MS = {}\n", super::GRACE_MS);
        assert!(super::PRELUDE.contains(&line), "the prelude lacks {line:?}");
    }

    /// The prelude's `dec` writes every whole number the scripts store (times in ms,
    /// epochs in µs) digit for digit as Rust does: fenced writes compare epochs as
    /// these strings.
    #[tokio::test]
    async fn dec_writes_numbers_as_rust_does() {
        let url =
            std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let required = std::env::var("IDEM_REQUIRE_DB").as_deref() == Ok("1");
        let conn = match ::redis::Client::open(url.as_str()) {
            Ok(client) => client.get_multiplexed_async_connection().await,
            Err(e) => Err(e),
        };
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) if required => panic!("Redis not reachable at {url} and IDEM_REQUIRE_DB=1: {e}"),
            Err(_) => {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "skipping: Redis not reachable at {url} (set IDEM_REDIS_URL)"
                );
                return;
            }
        };
        let numbers: [u64; 9] = [
            0,
            7,
            999_999_999,
            1_000_000_000,
            1_000_000_007,
            1_796_481_367_435,
            1_796_481_367_000_042,
            4_000_000_000_000_001,
            (1 << 53) - 1,
        ];
        let list: Vec<String> = numbers.iter().map(u64::to_string).collect();
        let body = format!("return {{dec({})}}", list.join("), dec("));
        let script = ::redis::Script::new(&format!("{}\n{body}", super::PRELUDE));
        let written: Vec<String> = script
            .key("idem-test:dec:r")
            .key("idem-test:dec:s")
            .invoke_async(&mut conn)
            .await
            .expect("run dec");
        assert_eq!(written, list);
    }
}
