//! The behaviour suite's harness: every test is written once and instantiated per
//! store with `suite!`.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_runtime::{Idem, IdemBuilder, IdemError};
// The scaffolding idem-cli's tests use too (not every test binary uses all of it).
#[allow(unused_imports)]
pub use idem_test_support::{
    db_required, delete_redis_prefix, have, listens, mysql_url, need, postgres_url,
    reached_or_skip, redis_url, scan_keys, skip, spare_port, unique_prefix, unique_table,
};

/// One store under test, able to open more handles on the same records.
pub struct Ctx {
    pub backend: Backend,
    pub idem: Idem,
    target: Target,
    _dir: Option<tempfile::TempDir>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Sqlite,
    Postgres,
    Redis,
    MySql,
}

enum Target {
    Memory,
    Sqlite(String),
    Postgres { url: String, table: String },
    Redis { url: String, prefix: String },
    MySql { url: String, table: String },
}

/// Whether anything listens at the Redis URL's host and port, asked once per test
/// binary with a short timeout.
pub fn redis_reachable() -> bool {
    static UP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UP.get_or_init(|| {
        use redis::IntoConnectionInfo;
        use std::net::ToSocketAddrs;
        let Ok(info) = redis_url().into_connection_info() else {
            return false;
        };
        let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
            return false;
        };
        (host.as_str(), *port)
            .to_socket_addrs()
            .is_ok_and(|mut addrs| {
                addrs.any(|a| {
                    std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(2))
                        .is_ok()
                })
            })
    })
}

/// The skip for Redis tests outside CI; `None` when they should run.
pub fn redis_skip(test: &str) -> Option<()> {
    if db_required() || redis_reachable() {
        return None;
    }
    skip(
        test,
        &format!(
            "Redis not reachable at {}; set IDEM_REDIS_URL, or IDEM_REQUIRE_DB=1 to fail instead",
            redis_url()
        ),
    );
    Some(())
}

/// The calls of each command the Redis server at `url` ran since the last reset, as
/// `(name, calls)` (`eval`, `evalsha`, `hmget`, ...); resets the counters.
pub async fn redis_command_calls(url: &str) -> Vec<(String, u64)> {
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut c)
        .await
        .unwrap();
    stats
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// A connection to the test Redis and the keys of every record under `prefix`, the
/// whole keyspace scanned.
pub async fn redis_record_keys(prefix: &str) -> (redis::aio::MultiplexedConnection, Vec<String>) {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let found = scan_keys(&mut conn, &format!("{prefix}:r:*"))
        .await
        .unwrap();
    (conn, found)
}

/// Whether anything listens at the PostgreSQL URL's host and port, asked once per test
/// binary with a short timeout, so a machine without PostgreSQL skips at once instead
/// of waiting out a pool's connect timeout in every test.
pub fn postgres_reachable() -> bool {
    static UP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UP.get_or_init(|| {
        #[cfg(feature = "postgres")]
        {
            let Ok(opts) =
                <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&postgres_url())
            else {
                return false;
            };
            listens(opts.get_host(), opts.get_port())
        }
        #[cfg(not(feature = "postgres"))]
        false
    })
}

/// Whether anything listens at the MySQL URL's host and port, asked once per test binary
/// with a short timeout.
pub fn mysql_reachable() -> bool {
    static UP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UP.get_or_init(|| {
        #[cfg(feature = "mysql")]
        {
            let Ok(opts) =
                <sqlx::mysql::MySqlConnectOptions as std::str::FromStr>::from_str(&mysql_url())
            else {
                return false;
            };
            listens(opts.get_host(), opts.get_port())
        }
        #[cfg(not(feature = "mysql"))]
        false
    })
}

/// The skip for MySQL/MariaDB tests outside CI; `None` when they should run.
pub fn mysql_skip(test: &str) -> Option<()> {
    if db_required() || mysql_reachable() {
        return None;
    }
    skip(
        test,
        &format!(
            "MySQL not reachable at {}; set IDEM_MYSQL_URL, or IDEM_REQUIRE_DB=1 to fail instead",
            mysql_url()
        ),
    );
    Some(())
}

/// Drops a MySQL idem table a test made (with its epoch counter and meta table) and
/// forgets its migrations.
#[cfg(feature = "mysql")]
pub async fn drop_mysql_table(url: &str, table: &str) {
    let Ok(pool) = sqlx::MySqlPool::connect(url).await else {
        return;
    };
    for t in [
        format!("{table}_steps"),
        table.to_owned(),
        format!("{table}_meta"),
        format!("{table}_epoch_seq"),
    ] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS `{t}`"))
            .execute(&pool)
            .await;
    }
    for procedure in ["claim", "claim_v2"] {
        let _ = sqlx::query(&format!("DROP PROCEDURE IF EXISTS `{table}_{procedure}`"))
            .execute(&pool)
            .await;
    }
    let _ = sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = ?")
        .bind(table)
        .execute(&pool)
        .await;
    pool.close().await;
}

/// The skip for PostgreSQL tests outside CI; `None` when they should run.
pub fn postgres_skip(test: &str) -> Option<()> {
    if db_required() || postgres_reachable() {
        return None;
    }
    skip(
        test,
        &format!(
            "PostgreSQL not reachable at {}; set IDEM_POSTGRES_URL, or IDEM_REQUIRE_DB=1 to fail instead",
            postgres_url()
        ),
    );
    Some(())
}

impl Ctx {
    /// Opens the backend for `test`, or `None` (with one line saying why) when
    /// PostgreSQL is unreachable outside CI.
    pub async fn open(backend: Backend, test: &str) -> Option<Ctx> {
        Self::open_with(backend, test, |b| b).await
    }

    pub async fn open_with(
        backend: Backend,
        test: &str,
        f: impl Fn(IdemBuilder) -> IdemBuilder,
    ) -> Option<Ctx> {
        if backend == Backend::Postgres && postgres_skip(test).is_some() {
            return None;
        }
        if backend == Backend::Redis && redis_skip(test).is_some() {
            return None;
        }
        if backend == Backend::MySql && mysql_skip(test).is_some() {
            return None;
        }
        let (target, dir) = match backend {
            Backend::Memory => (Target::Memory, None),
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!("sqlite://{}", dir.path().join("idem.db").display());
                (Target::Sqlite(url), Some(dir))
            }
            Backend::Postgres => (
                Target::Postgres {
                    url: postgres_url(),
                    table: unique_table(test),
                },
                None,
            ),
            Backend::Redis => (
                Target::Redis {
                    url: redis_url(),
                    prefix: unique_prefix(test),
                },
                None,
            ),
            Backend::MySql => (
                Target::MySql {
                    url: mysql_url(),
                    table: unique_table(test),
                },
                None,
            ),
        };
        let mut ctx = Ctx {
            backend,
            idem: Idem::memory(),
            target,
            _dir: dir,
        };
        // A server that refuses the connection skips the test outside CI.
        let server = match backend {
            Backend::Postgres => Some(("PostgreSQL", postgres_url())),
            Backend::Redis => Some(("Redis", redis_url())),
            Backend::MySql => Some(("MySQL", mysql_url())),
            Backend::Memory | Backend::Sqlite => None,
        };
        ctx.idem = match (ctx.handle(f).await, server) {
            (Ok(idem), _) => idem,
            (Err(e), Some((what, url))) => reached_or_skip(test, what, &url, Err::<Idem, _>(e))?,
            (Err(e), None) => panic!("cannot open {backend:?} store for {test}: {e}"),
        };
        Some(ctx)
    }

    /// Another handle on the same records (another "process" for the memory store is
    /// not possible, so it shares the first handle there), with other options.
    pub async fn handle(&self, f: impl Fn(IdemBuilder) -> IdemBuilder) -> Result<Idem, IdemError> {
        // The SQL stores run the suite without the in-process replay cache, so every
        // duplicate exercises the store's own decision (the cache has tests of its own).
        // The stress tests queue thousands of calls on a few connections of a loaded
        // machine: the wait for a connection counts toward the store timeout, and
        // shedding that load is not what they test (tests/suite/wire_faults.rs tests the bound).
        let base = Idem::builder().store_timeout(std::time::Duration::from_secs(120));
        let b = match self.target {
            Target::Memory => f(base),
            _ => f(base.replay_cache_bytes(0)),
        };
        match &self.target {
            Target::Memory => Ok(b.memory()),
            Target::Sqlite(url) => b.sqlite(url).await,
            #[cfg(feature = "postgres")]
            Target::Postgres { url, table } => b.table(table.clone()).postgres(url).await,
            #[cfg(not(feature = "postgres"))]
            Target::Postgres { .. } => Err(IdemError::Config {
                message: "built without the `postgres` feature".into(),
            }),
            Target::Redis { url, prefix } => b.key_prefix(prefix.clone()).redis(url).await,
            #[cfg(feature = "mysql")]
            Target::MySql { url, table } => b.table(table.clone()).mysql(url).await,
            #[cfg(not(feature = "mysql"))]
            Target::MySql { .. } => Err(IdemError::Config {
                message: "built without the `mysql` feature".into(),
            }),
        }
    }

    /// A handle with other options on the same records; the memory store cannot share
    /// records across handles, so it gets a fresh one that the test must use alone.
    pub async fn variant(&self, f: impl Fn(IdemBuilder) -> IdemBuilder) -> Idem {
        self.handle(f).await.expect("open a second handle")
    }
}

/// What a test leaves behind on PostgreSQL or Redis, dropped after it passes (a failed
/// test's table or keys stay for inspection).
pub struct Cleanup(
    Option<(String, String)>,
    Option<(String, String)>,
    Option<(String, String)>,
);

impl Ctx {
    pub fn cleanup(&self) -> Cleanup {
        match &self.target {
            Target::Postgres { url, table } => {
                Cleanup(Some((url.clone(), table.clone())), None, None)
            }
            Target::Redis { url, prefix } => {
                Cleanup(None, Some((url.clone(), prefix.clone())), None)
            }
            Target::MySql { url, table } => Cleanup(None, None, Some((url.clone(), table.clone()))),
            _ => Cleanup(None, None, None),
        }
    }
}

impl Cleanup {
    /// The cleanup of a PostgreSQL table a test opened itself.
    pub fn for_table(table: &str) -> Cleanup {
        Cleanup(Some((postgres_url(), table.to_owned())), None, None)
    }

    /// The cleanup of a MySQL table a test opened itself.
    pub fn for_mysql_table(table: &str) -> Cleanup {
        Cleanup(None, None, Some((mysql_url(), table.to_owned())))
    }

    /// The cleanup of Redis keys under a prefix a test used itself.
    pub fn for_redis_prefix(prefix: &str) -> Cleanup {
        Cleanup(None, Some((redis_url(), prefix.to_owned())), None)
    }

    pub async fn run(self) {
        if let Some((url, prefix)) = &self.1 {
            delete_redis_prefix(url, prefix).await;
        }
        #[cfg(feature = "mysql")]
        if let Some((url, table)) = &self.2 {
            drop_mysql_table(url, table).await;
        }
        #[cfg(feature = "postgres")]
        if let Some((url, table)) = self.0
            && let Ok(pool) = sqlx::PgPool::connect(&url).await
        {
            // Several statements: a raw query, which sqlx sends unprepared.
            let _ = sqlx::raw_sql(&format!(
                "DROP TABLE IF EXISTS {table}_steps; DROP TABLE IF EXISTS {table}_claim_limits; \
                 DROP TABLE IF EXISTS {table}; \
                 DROP TABLE IF EXISTS {table}_meta; DROP SEQUENCE IF EXISTS {table}_epoch_seq"
            ))
            .execute(&pool)
            .await;
            let _ = sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = $1")
                .bind(&table)
                .execute(&pool)
                .await;
        }
    }
}

/// Drops a schema a test made, with everything in it.
#[cfg(feature = "postgres")]
pub async fn drop_schema(pool: &sqlx::PgPool, schema: &str) {
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(pool)
        .await;
}

/// `tasks` callers released together on one key per round, for `rounds` rounds;
/// asserts that every caller of a round sees its one execution and that the body ran
/// once per round.
pub async fn contend_one_key(idem: &Idem, tasks: usize, rounds: u32) {
    use std::time::Duration;
    for round in 0..rounds {
        let runs = Counter::default();
        let barrier = Arc::new(tokio::sync::Barrier::new(tasks));
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let (idem, runs, barrier) = (idem.clone(), runs.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    idem.operation("charge", &round)
                        .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(300)))
                        .fingerprint(&"same payload")
                        .retain(std::time::Duration::from_secs(86_400))
                        .run(move || async move {
                            let n = runs.hit();
                            tokio::task::yield_now().await;
                            Ok::<_, IdemError>(n)
                        })
                        .await
                })
            })
            .collect();
        for h in handles {
            assert_eq!(
                h.await.unwrap().unwrap(),
                1,
                "every caller sees the one execution"
            );
        }
        assert_eq!(
            runs.get(),
            1,
            "round {round}: the body ran {} times",
            runs.get()
        );
    }
}

/// `callers` callers on each of `keys` keys, all released together; asserts each gets
/// its key's outcome and returns how many times bodies ran.
pub async fn contend_many_keys(idem: &Idem, keys: usize, callers: usize) -> usize {
    use std::time::Duration;
    let runs = Counter::default();
    let barrier = Arc::new(tokio::sync::Barrier::new(keys * callers));
    let handles: Vec<_> = (0..keys * callers)
        .map(|i| {
            let (idem, runs, barrier) = (idem.clone(), runs.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let key = i % keys;
                idem.operation("deliver", &key)
                    .in_flight(idem_runtime::InFlight::Wait(Duration::from_secs(300)))
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(move || async move {
                        runs.hit();
                        Ok::<_, IdemError>(key)
                    })
                    .await
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.await.unwrap().unwrap(), i % keys);
    }
    runs.get()
}

/// Two `idem-race-worker` processes racing in transactional mode on keys `0..keys`
/// (see `tests/bin/race_worker.rs` for `url` and `namespace`); asserts both succeeded
/// and returns how many bodies they ran in total.
pub async fn race_two_processes(url: &str, namespace: &str, keys: u32) -> u32 {
    let spawn = |worker: &str| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_idem-race-worker"))
            .args([url, namespace, &keys.to_string(), worker])
            .output()
    };
    let (a, b) = tokio::join!(spawn("a"), spawn("b"));
    let mut ran = 0;
    for out in [a.unwrap(), b.unwrap()] {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "worker failed: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ran += stdout
            .lines()
            .find_map(|l| l.strip_prefix("RAN="))
            .and_then(|n| n.parse::<u32>().ok())
            .expect("worker printed its count");
    }
    ran
}

/// A call of `name` on `key` kept for `retain`, whose body counts itself in `runs` and
/// returns `value`.
pub async fn counted_call(
    idem: &Idem,
    name: &str,
    key: &str,
    retain: std::time::Duration,
    runs: &Counter,
    value: u32,
) -> Result<u32, IdemError> {
    idem.operation(name, key)
        .retain(retain)
        .fingerprint_none()
        .run(|| async {
            runs.hit();
            Ok::<_, IdemError>(value)
        })
        .await
}

/// Counts body executions.
#[derive(Clone, Default)]
pub struct Counter(Arc<AtomicUsize>);

impl Counter {
    pub fn hit(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// An error type for bodies, recordable and convertible from `IdemError`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum AppError {
    Declined(String),
    Timeout,
    Idem(String),
}

impl From<IdemError> for AppError {
    fn from(e: IdemError) -> Self {
        AppError::Idem(e.to_string())
    }
}

/// Instantiates each named `async fn(Ctx)` once per backend.
#[macro_export]
macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        // The one list of backends every behaviour test runs on.
        suite!(@backends [memory Memory, sqlite Sqlite, postgres Postgres, redis Redis, mysql MySql] ($($name),*));
    };
    (@backends [$($module:ident $backend:ident),*] $names:tt) => {
        $(suite!(@one $module $backend $names);)*
    };
    (@one $module:ident $backend:ident ($($name:ident),*)) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let backend = $crate::common::Backend::$backend;
                    if let Some(ctx) = $crate::common::Ctx::open(backend, stringify!($name)).await {
                        let cleanup = ctx.cleanup();
                        super::$name(ctx).await;
                        cleanup.run().await;
                    }
                }
            )*
        }
    };
}

/// Holds a claim on `key` (operation `send`, fingerprint `payload`) until the returned
/// sender fires; the call then records `payload`.
pub async fn hold(
    idem: &Idem,
    key: &'static str,
    payload: u32,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<u32, IdemError>>,
) {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let idem = idem.clone();
    let task = tokio::spawn(async move {
        idem.operation("send", key)
            .fingerprint(&payload)
            .retain(std::time::Duration::from_secs(86_400))
            .run(move || async move {
                let _ = started_tx.send(());
                let _ = go_rx.await;
                Ok::<_, IdemError>(payload)
            })
            .await
    });
    started_rx.await.unwrap();
    (go_tx, task)
}

/// A call on `owner` whose body holds until a waiting duplicate on `waiter` (another
/// handle, so another process as far as the store knows, whose poll interval should be
/// an hour) has announced itself, as `flagged` reports; returns what the waiter got
/// once the first call recorded 7. Panics if the waiter is not woken within 30 s, a
/// liveness bound rather than a speed claim: unwoken, it would sleep an hour.
pub async fn waiter_on_another_handle<F, Fut>(owner: Idem, waiter: Idem, flagged: F) -> u32
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let finish = async |go: tokio::sync::oneshot::Sender<()>| go.send(()).unwrap();
    waiter_on_another_handle_finishing(owner, waiter, flagged, finish).await
}

/// As [`waiter_on_another_handle`], where `finish` lets the first call's body end (by
/// sending on the sender it is given) in circumstances of the test's choosing.
pub async fn waiter_on_another_handle_finishing<F, Fut>(
    owner: Idem,
    waiter: Idem,
    flagged: F,
    finish: impl AsyncFnOnce(tokio::sync::oneshot::Sender<()>),
) -> u32
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let (go_tx, first) = hold(&owner, "w-1", 7).await;
    let second = tokio::spawn(async move {
        waiter
            .operation("send", "w-1")
            .fingerprint(&7u32)
            .in_flight(idem_runtime::InFlight::Wait(
                std::time::Duration::from_secs(3600),
            ))
            .retain(std::time::Duration::from_secs(86_400))
            .run(|| async { Ok::<_, IdemError>(99u32) })
            .await
    });
    // Finish only once the waiter has announced itself, so the wake-up is what ends
    // its wait.
    while !flagged().await {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    finish(go_tx).await;
    assert_eq!(first.await.unwrap().unwrap(), 7);
    tokio::time::timeout(std::time::Duration::from_secs(30), second)
        .await
        .expect("the waiter was never woken")
        .unwrap()
        .unwrap()
}

/// A store reached only through the `Store` trait, as one of the application's own is:
/// nothing is taken at once in this process, so the replay cache and lease renewals
/// apply to it as to a remote store.
pub struct ThroughTrait<S>(pub S);

impl<S: idem_runtime::store::Store> idem_runtime::store::Delegate for ThroughTrait<S> {
    fn inner(&self) -> &dyn idem_runtime::store::Store {
        &self.0
    }
}

/// The memory store behind [`ThroughTrait`], for `IdemBuilder::store`.
pub fn memory_through_trait() -> Arc<dyn idem_runtime::store::Delegate> {
    Arc::new(ThroughTrait(idem_runtime::store::MemoryStore::default()))
}

/// Opens an `Idem` with `open`, given `b` with a layer hook added, and returns it with
/// the store it runs on as the hook saw it: a check of the store then runs on exactly
/// what the builder opened.
pub async fn open_with_store(
    b: IdemBuilder,
    open: impl AsyncFnOnce(IdemBuilder) -> Idem,
) -> (Idem, Arc<dyn idem_runtime::store::Store>) {
    let slot = Arc::new(std::sync::Mutex::new(None));
    let s = slot.clone();
    let idem = open(b.layer(move |store| {
        *s.lock().unwrap() = Some(store.clone());
        store
    }))
    .await;
    let store = slot
        .lock()
        .unwrap()
        .take()
        .expect("the layer saw the store");
    (idem, store)
}
