//! The test scaffolding the workspace's test suites share: the behaviour suite (`tests/`,
//! through `tests/common`) and the `idem` binary's tests (`idem-cli/tests`). Not
//! published.
//!
//! - Where the shared servers are: [`postgres_url`], [`mysql_url`], [`redis_url`]
//!   (`IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`, `IDEM_REDIS_URL`, a local server by default).
//! - Skip or require: a test that cannot reach its server, or lacks the binaries of one
//!   it starts itself, skips with one line saying why ([`skip`], [`need`],
//!   [`reached_or_skip`]), unless `IDEM_REQUIRE_DB=1` ([`db_required`]) makes that a
//!   failure.
//! - Names of a test's own: [`unique_table`], [`unique_prefix`].
//! - Servers a test runs itself: [`spare_port`], [`listens`], [`have`], and
//!   [`RedisCluster`], a throwaway three-master Redis Cluster.
//! - Redis keys: [`scan_keys`], and [`delete_redis_prefix`] for cleanup.

use std::fmt::Display;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The shared PostgreSQL server: `IDEM_POSTGRES_URL`, else a local one.
pub fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The shared MySQL/MariaDB server: `IDEM_MYSQL_URL`, else a local one.
pub fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// The shared Redis server: `IDEM_REDIS_URL`, else a local one.
pub fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// The local DynamoDB-compatible server (`IDEM_DYNAMODB_URL`).
pub fn dynamodb_url() -> String {
    std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:8000".into())
}

/// Whether a test must fail, rather than skip, when its server or binaries are missing
/// (`IDEM_REQUIRE_DB=1`, as CI sets it).
pub fn db_required() -> bool {
    std::env::var("IDEM_REQUIRE_DB").is_ok_and(|v| v == "1")
}

/// Says, in one line that the test harness does not capture, that `test` is skipped.
pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skipping {test}: {why}");
}

/// `Some(())` when `found` (what `test` needs is installed); else `None` after a skip
/// line naming `what`, or a panic under `IDEM_REQUIRE_DB=1`.
pub fn need(test: &str, found: bool, what: &str) -> Option<()> {
    if found {
        return Some(());
    }
    assert!(
        !db_required(),
        "IDEM_REQUIRE_DB=1 but {what} is not installed (needed by {test})"
    );
    skip(test, &format!("{what} is not installed"));
    None
}

/// What `reached` holds when `test` reached `what` (a server, a pool, a store) at `url`;
/// else `None` after a skip line, or a panic under `IDEM_REQUIRE_DB=1`.
pub fn reached_or_skip<T, E: Display>(
    test: &str,
    what: &str,
    url: &str,
    reached: Result<T, E>,
) -> Option<T> {
    match reached {
        Ok(value) => Some(value),
        Err(e) if !db_required() => {
            skip(
                test,
                &format!("{what} at {url} refused the connection ({e})"),
            );
            None
        }
        Err(e) => panic!("{what} at {url} is required (IDEM_REQUIRE_DB=1) but not reachable: {e}"),
    }
}

/// A table name of its own for each test (and each call), so counts are exact and tests
/// run in parallel: `idem_t_<test>_<pid>_<n>`.
pub fn unique_table(test: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut t: String = test
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    t.truncate(30);
    format!("idem_t_{t}_{}_{n}", std::process::id())
}

/// A Redis key prefix of its own for each test (and each call), as [`unique_table`].
pub fn unique_prefix(test: &str) -> String {
    format!("idem-test:{}", unique_table(test))
}

/// Whether `binary --version` runs, for tests that start servers of their own.
pub fn have(binary: &str) -> bool {
    Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether anything accepts a TCP connection at `host:port` within two seconds.
pub fn listens(host: &str, port: u16) -> bool {
    use std::net::ToSocketAddrs;
    (host, port).to_socket_addrs().is_ok_and(|mut addrs| {
        addrs.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
    })
}

/// A port of 127.0.0.1 nothing listens on now.
pub fn spare_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a spare port")
        .local_addr()
        .expect("the spare port's address")
        .port()
}

/// A spare port not in `taken` whose cluster bus port (+10000) is spare too.
fn spare_cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = spare_port();
        if port > 55_000 || taken.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// The keys matching `pattern` on the Redis server of `conn`, the whole keyspace scanned
/// (one `SCAN` call covers only part of it); a key may be listed twice.
pub async fn scan_keys(
    conn: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let mut found = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        found.extend(keys);
        cursor = next;
        if cursor == 0 {
            return Ok(found);
        }
    }
}

/// Deletes every key under `prefix` (records and steps) on the Redis server at `url`;
/// does nothing if it cannot be reached.
pub async fn delete_redis_prefix(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else {
        return;
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let Ok(keys) = scan_keys(&mut conn, &format!("{prefix}:*")).await else {
        return;
    };
    for k in keys {
        let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(k).query_async(&mut conn).await;
    }
}

/// A Redis Cluster of three masters (`redis-server --cluster-enabled yes` on spare
/// ports of 127.0.0.1, no persistence, its files in a temporary folder), made with
/// `redis-cli --cluster create`. Dropped, its servers are killed by their pids.
pub struct RedisCluster {
    children: Vec<Child>,
    ports: Vec<u16>,
    dir: tempfile::TempDir,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl RedisCluster {
    /// Starts the cluster and waits until every node reports `cluster_state:ok`; `None`
    /// (after a skip line) when `redis-server` or `redis-cli` is missing, a panic then
    /// under `IDEM_REQUIRE_DB=1`.
    pub async fn start(test: &str) -> Option<RedisCluster> {
        need(
            test,
            have("redis-server") && have("redis-cli"),
            "redis-server or redis-cli",
        )?;
        let mut cluster = RedisCluster {
            children: Vec::new(),
            ports: Vec::new(),
            dir: tempfile::tempdir().expect("temp dir"),
        };
        for _ in 0..3 {
            let port = spare_cluster_port(&cluster.ports);
            let conf = cluster.dir.path().join(format!("nodes-{port}.conf"));
            let child = Command::new("redis-server")
                .args(["--cluster-enabled", "yes", "--port", &port.to_string()])
                .arg("--cluster-config-file")
                .arg(&conf)
                .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                .args(["--daemonize", "no"])
                .current_dir(cluster.dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            cluster.children.push(child);
            cluster.ports.push(port);
        }
        for port in &cluster.ports {
            cluster.wait_for(*port, |_| true).await;
        }
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for port in &cluster.ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let out = create
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for port in &cluster.ports {
            cluster
                .wait_for(*port, |info| info.contains("cluster_state:ok"))
                .await;
        }
        Some(cluster)
    }

    /// Waits until the node at `port` answers `CLUSTER INFO` with what `ok` wants.
    async fn wait_for(&self, port: u16, ok: impl Fn(&str) -> bool) {
        for _ in 0..600 {
            if let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                && let Ok(mut c) = client.get_multiplexed_async_connection().await
                && let Ok(info) = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async::<String>(&mut c)
                    .await
                && ok(&info)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the cluster node on port {port} never got ready");
    }

    /// The masters' ports.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// The masters' URLs, `redis://127.0.0.1:PORT`.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }
}
