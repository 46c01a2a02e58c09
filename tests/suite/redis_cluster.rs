//! The Redis store on a real three-master Redis Cluster started for the test: the
//! conformance suite, callers contending on one key and on many keys spread over every
//! slot range, and replays read without a script.
use crate::common;

use std::time::Duration;

use idem_runtime::Idem;
use idem_runtime::store::conformance;
use idem_test_support::RedisCluster;

/// The shared throwaway cluster, with what these tests ask of it.
struct Cluster(RedisCluster);

impl Cluster {
    async fn start(test: &str) -> Option<Cluster> {
        RedisCluster::start(test).await.map(Cluster)
    }

    fn urls(&self) -> Vec<String> {
        self.0.urls()
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

    // Conformance, on the store `redis_cluster` opens. Thousands of calls at once below:
    // queueing is not what this measures.
    let b = Idem::builder().store_timeout(Duration::from_secs(120));
    let (idem, store) = common::open_with_store(b, async |b| cluster.open(b).await).await;
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
