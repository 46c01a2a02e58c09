//! The Redis store on a real three-master Redis Cluster started for the test: the
//! conformance suite, callers contending on one key and on many keys spread over every
//! slot range, and replays read without a script.
use crate::common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idem_runtime::Idem;
use idem_runtime::store::conformance;

/// Three `redis-server --cluster-enabled yes` processes, killed on drop.
struct Cluster {
    children: Vec<Child>,
    ports: Vec<u16>,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port free now, whose cluster bus port (+10000) is free too.
fn spare_port(taken: &[u16]) -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().unwrap().port();
        if port > 55_000 || taken.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

impl Cluster {
    /// Starts the cluster, or `None` (with one line) when the Redis binaries are missing
    /// outside CI.
    async fn start(test: &str) -> Option<Cluster> {
        if !(common::have("redis-server") && common::have("redis-cli")) {
            assert!(
                !common::db_required(),
                "redis-server and redis-cli are needed for {test}"
            );
            common::skip(test, "redis-server or redis-cli not installed");
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cluster = Cluster {
            children: Vec::new(),
            ports: Vec::new(),
            _dir: dir,
        };
        for _ in 0..3 {
            let port = spare_port(&cluster.ports);
            let conf = cluster._dir.path().join(format!("nodes-{port}.conf"));
            let child = Command::new("redis-server")
                .args(["--cluster-enabled", "yes", "--port", &port.to_string()])
                .arg("--cluster-config-file")
                .arg(&conf)
                .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                .args(["--daemonize", "no"])
                .current_dir(cluster._dir.path())
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
        create.arg("--cluster").arg("create");
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

    fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    async fn open(&self, b: idem_runtime::IdemBuilder) -> Idem {
        let urls = self.urls();
        let nodes: Vec<&str> = urls.iter().map(String::as_str).collect();
        b.key_prefix("idem-cluster")
            .replay_cache_bytes(0)
            .redis_cluster(&nodes)
            .await
            .expect("open the cluster store")
    }

    /// The scripts and `PTTL`s all masters ran since the last call (which resets the
    /// counters).
    async fn commands_run(&self) -> (u64, u64) {
        let (mut scripts, mut ttls) = (0, 0);
        for url in self.urls() {
            for (name, calls) in common::redis_command_calls(&url).await {
                if name.starts_with("eval") {
                    scripts += calls;
                } else if name == "pttl" {
                    ttls += calls;
                }
            }
        }
        (scripts, ttls)
    }

    /// How many keys each master holds.
    async fn key_counts(&self) -> Vec<u64> {
        let mut counts = Vec::new();
        for url in self.urls() {
            let client = redis::Client::open(url).unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            counts.push(redis::cmd("DBSIZE").query_async(&mut c).await.unwrap());
        }
        counts
    }
}

/// On a three-master cluster: the conformance suite passes, contending callers run each
/// body once with records on every master, replays are read without a script while they
/// come in, and a record past its retention runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_cluster_conforms_and_runs_each_body_once() {
    let Some(cluster) = Cluster::start("redis_cluster_conforms_and_runs_each_body_once").await
    else {
        return;
    };

    // Conformance, on the store `redis_cluster` opens.
    let slot = std::sync::Arc::new(std::sync::Mutex::new(None));
    let s = slot.clone();
    let idem = cluster
        // Thousands of calls at once below: queueing is not what this measures.
        .open(
            Idem::builder()
                .store_timeout(Duration::from_secs(120))
                .layer(move |store| {
                    *s.lock().unwrap() = Some(store.clone());
                    store
                }),
        )
        .await;
    let store = slot
        .lock()
        .unwrap()
        .take()
        .expect("the layer saw the store");
    conformance::run_all(&*store).await;

    // 64 callers on one key, 20 rounds: one body per round, every caller its outcome.
    common::contend_one_key(&idem, 64, 20).await;

    // 2,000 keys × 4 callers: every body once, with the keys spread over all masters.
    let runs = common::contend_many_keys(&idem, 2000, 4).await;
    assert_eq!(runs, 2000, "each key's body runs exactly once");
    let counts = cluster.key_counts().await;
    assert!(
        counts.iter().all(|&n| n > 100),
        "records on every master: {counts:?}"
    );
    // The store's SCAN reaches every master.
    let stats = idem.stats().await.expect("stats");
    assert!(stats.completed >= 2020, "{stats:?}");

    // Once replays come in, a replay is plain commands on the record's node, no script.
    // Checked on a record kept a minute, so no delay before the replays can expire it.
    let runs = common::Counter::default();
    let call = |key, retain| common::counted_call(&idem, "quote", key, retain, &runs, 42);
    let kept = || call("q-kept", Duration::from_secs(60));
    assert_eq!(kept().await.unwrap(), 42);
    assert_eq!(kept().await.unwrap(), 42);
    cluster.commands_run().await;
    for _ in 0..5 {
        assert_eq!(kept().await.unwrap(), 42);
    }
    assert_eq!(
        cluster.commands_run().await,
        (0, 5),
        "a run of replays: a PTTL each, no script"
    );
    assert_eq!(runs.get(), 1, "a kept record ran again");

    // A record past its retention (still kept by Redis for a while) runs again: the read
    // (a PTTL) finds it expired and leaves it to the claim. Only the sleep is timed, and
    // a longer one changes nothing.
    let brief = || call("q-brief", Duration::from_millis(300));
    assert_eq!(brief().await.unwrap(), 42);
    tokio::time::sleep(Duration::from_millis(400)).await;
    cluster.commands_run().await;
    assert_eq!(brief().await.unwrap(), 42);
    assert_eq!(
        cluster.commands_run().await.1,
        1,
        "while replays come in, the read (a PTTL) comes first"
    );
    assert_eq!(runs.get(), 3, "an expired record replayed");
    drop(idem);
    drop(cluster);
}
