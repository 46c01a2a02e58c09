//! Opening the store's connections and keeping them alive: a standalone server's two
//! command connections, replaced when one goes silent (`Healing`), a cluster's
//! connection, TLS, the wake-up subscription, the key-mode check at open, and how Redis
//! errors map to store errors.

use std::sync::Arc;
use std::time::Duration;

use ::redis::RedisError;
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster_async::ClusterConnection;

use super::RedisStore;
use super::wire::parse_wakeup;
use crate::error::{IdemError, StoreError};
use crate::store::WakeHub;

/// How long one command may take before it counts as a lost connection, on a store
/// connected without a builder; the builder's stores use their store timeout.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to a standalone server (reconnecting) or to a cluster.
// One per store, never moved around: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Conn {
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
pub(super) struct Healing {
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
pub(super) enum Lane {
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
    pub(super) async fn get(&self, lane: Lane) -> Result<ConnectionManager, RedisError> {
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
    pub(super) async fn run<T>(
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
        Ok(RedisStore::new(Conn::Single(healing), prefix, client))
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
        let conn = Conn::Cluster {
            conn,
            info: Box::new(info),
        };
        Ok(RedisStore::new(conn, prefix, pubsub))
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
}

/// Relays the wake-ups published on `channel` to `hub`, reconnecting after a drop (a
/// wake-up missed meanwhile costs its waiters one poll interval).
pub(super) async fn relay_wakeups(client: ::redis::Client, channel: String, hub: Arc<WakeHub>) {
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
pub(super) fn store_error(e: RedisError) -> StoreError {
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
