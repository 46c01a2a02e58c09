//! What only the Redis store does: wake-ups across handles through pub/sub, and a lost
//! server reported as unreachable.
use crate::common;
use crate::own_servers::OwnRedis;

use std::time::Duration;

use idem_runtime::{Idem, IdemError, OnStoreError};

/// Whether some record under `prefix` is flagged as waited on.
async fn flagged(prefix: &str) -> bool {
    let (mut c, keys) = common::redis_record_keys(prefix).await;
    for k in keys {
        let w: Option<String> = redis::cmd("HGET")
            .arg(&k)
            .arg("w")
            .query_async(&mut c)
            .await
            .unwrap();
        if w.is_some() {
            return true;
        }
    }
    false
}

/// How many connections subscribe to `channel`.
async fn subscribers(channel: &str) -> u64 {
    let client = redis::Client::open(common::redis_url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let (_, n): (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(&mut c)
        .await
        .unwrap();
    n
}

/// A waiter on another handle (another process, as far as the store knows) whose poll
/// interval is an hour gets the outcome when the first handle records it: the record
/// script published the wake-up and the waiter's handle relayed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_handle_wakes_waiters_through_pubsub() {
    let test = "another_handle_wakes_waiters_through_pubsub";
    if common::redis_skip(test).is_some() {
        return;
    }
    let prefix = common::unique_prefix(test);
    let open = |poll: Duration| {
        let prefix = prefix.clone();
        async move {
            Idem::builder()
                .key_prefix(prefix)
                .replay_cache_bytes(0)
                .poll_interval(poll)
                .redis(&common::redis_url())
                .await
                .expect("open")
        }
    };
    let (owner, waiter) = (
        open(Duration::from_millis(200)).await,
        open(Duration::from_secs(3600)).await,
    );
    // Both handles subscribe in the background when they open; a wake-up published
    // before the waiter's handle has subscribed would be missed.
    while subscribers(&format!("{prefix}:wake")).await < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let woken = common::waiter_on_another_handle(owner, waiter, || flagged(&prefix)).await;
    assert_eq!(woken, 7, "the waiter replays the outcome");
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

/// A store that cannot be reached is a retryable error, and an unreachable one:
/// `fail_open` runs the body unprotected, `fail_closed` refuses.
#[tokio::test]
async fn lost_server_is_unreachable() {
    let test = "lost_server_is_unreachable";
    if common::redis_skip(test).is_some() {
        return;
    }
    // Connecting to nothing fails at open, retryable.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    match Idem::redis(&format!("redis://127.0.0.1:{closed}")).await {
        Err(e @ IdemError::Store { .. }) => assert!(e.is_retryable(), "{e}"),
        Err(e) => panic!("expected a store error, got {e}"),
        Ok(_) => panic!("opened a store on a closed port"),
    }

    // A server that goes away after the open: a throwaway redis-server.
    let Some(server) = OwnRedis::start(test, &[]) else {
        return;
    };
    let url = server.url();
    let mut idem = None;
    for _ in 0..200 {
        if let Ok(i) = Idem::builder().replay_cache_bytes(0).redis(&url).await {
            idem = Some(i);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let idem = idem.expect("the throwaway server never answered");
    assert_eq!(
        idem.operation("send", "u-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(1) })
            .await
            .unwrap(),
        1
    );
    // Killed, and waited for.
    drop(server);

    let closed = idem
        .operation("send", "u-2")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(2) })
        .await;
    match closed {
        Err(e @ IdemError::Store { .. }) => assert!(e.is_retryable(), "{e}"),
        other => panic!("expected a retryable store error, got {other:?}"),
    }
    let open = idem
        .operation("send", "u-3")
        .on_store_error(OnStoreError::FailOpen)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(3) })
        .await;
    assert_eq!(
        open.unwrap(),
        3,
        "fail_open runs the body when Redis is gone"
    );
}

/// A handle on the server at `url` (under `prefix`, if given) with the replay cache
/// off, so every call reaches the server.
async fn uncached(url: &str, prefix: Option<&str>) -> Idem {
    let builder = Idem::builder().replay_cache_bytes(0);
    let builder = match prefix {
        Some(prefix) => builder.key_prefix(prefix),
        None => builder,
    };
    builder.redis(url).await.expect("open")
}

/// The TTLs behind the module's promises: an in-progress record never expires; a
/// completed one expires by itself shortly after its retention; a released one is
/// gone, and nothing of its operation stays behind (epochs come from the server's
/// clock, so no key has to outlive a record to keep them from repeating).
#[tokio::test]
async fn records_expire_by_themselves_and_leave_nothing_behind() {
    let test = "records_expire_by_themselves_and_leave_nothing_behind";
    if common::redis_skip(test).is_some() {
        return;
    }
    let prefix = common::unique_prefix(test);
    let idem = uncached(&common::redis_url(), Some(&prefix)).await;
    let client = redis::Client::open(common::redis_url()).unwrap();
    let c = client.get_multiplexed_async_connection().await.unwrap();
    // The operations' keys under the prefix (the key-mode key left out), sorted.
    let keys = || {
        let (prefix, mut c) = (prefix.clone(), c.clone());
        async move {
            let mut keys = common::scan_keys(&mut c, &format!("{prefix}:*"))
                .await
                .unwrap();
            keys.retain(|k| !k.starts_with(&format!("{prefix}:m:")));
            keys.sort();
            keys.dedup();
            keys
        }
    };
    let pttl = |key: String| {
        let mut c = c.clone();
        async move {
            redis::cmd("PTTL")
                .arg(key)
                .query_async::<i64>(&mut c)
                .await
                .unwrap()
        }
    };
    let hour = Duration::from_secs(3600);
    let grace = 5 * 60 * 1000;

    // In progress: the record alone, with no expiry.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let owner = idem.clone();
    let running = tokio::spawn(async move {
        owner
            .operation("send", "t-1")
            .retain(hour)
            .fingerprint_none()
            .run(move || async move {
                let _ = started_tx.send(());
                let _ = go_rx.await;
                Ok::<_, IdemError>(1)
            })
            .await
    });
    started_rx.await.unwrap();
    let rec = keys().await;
    assert_eq!(
        rec.len(),
        1,
        "one key for an operation in progress: {rec:?}"
    );
    assert!(rec[0].starts_with(&format!("{prefix}:r:")), "{rec:?}");
    assert_eq!(
        pttl(rec[0].clone()).await,
        -1,
        "an in-progress record never expires"
    );

    // Completed: the record goes shortly after its retention.
    go_tx.send(()).unwrap();
    assert_eq!(running.await.unwrap().unwrap(), 1);
    let rec_ttl = pttl(rec[0].clone()).await;
    assert!(
        rec_ttl > 3_600_000 - 60_000 && rec_ttl <= 3_600_000 + grace,
        "completed record TTL {rec_ttl}"
    );

    // Released: the record is gone, and no other key of the operation is left.
    let released = idem
        .operation("send", "t-2")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            Err::<u32, IdemError>(IdemError::Config {
                message: "no".into(),
            })
        })
        .await;
    assert!(released.is_err());
    assert_eq!(
        keys().await,
        rec,
        "only the completed record is left after a release"
    );
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

/// A `redis-server` of this test's own on a spare port (its command counters are this
/// test's alone), killed on drop.
struct OwnServer {
    _server: OwnRedis,
    url: String,
}

impl OwnServer {
    async fn start(test: &str) -> Option<OwnServer> {
        let server = OwnRedis::start(test, &[])?;
        Some(OwnServer {
            url: server.url(),
            _server: server,
        })
    }

    /// The commands the server ran since the last call, by name (and resets the
    /// counters): `(scripts, HMGETs)`.
    async fn commands_run(&self) -> (u64, u64) {
        let calls = common::redis_command_calls(&self.url).await;
        let sum = |wanted: fn(&str) -> bool| -> u64 {
            calls
                .iter()
                .filter(|(n, _)| wanted(n))
                .map(|(_, c)| c)
                .sum()
        };
        (sum(|n| n.starts_with("eval")), sum(|n| n == "hmget"))
    }

    /// A handle on this server with the replay cache off.
    async fn idem_uncached(&self) -> Idem {
        uncached(&self.url, None).await
    }

    /// Scripts the server ran since the last call (and resets the counters).
    async fn scripts_run(&self) -> u64 {
        self.commands_run().await.0
    }
}

/// A fresh call is two round trips (the claim script, the record script) and a replay
/// one: the claim script itself decides fresh, replay, in flight and mismatch. Once
/// replays come in, a replay is no script at all: one `HMGET` (with `TIME` pipelined
/// when none was read in the last second), which finds a record past its retention no
/// replay.
#[tokio::test]
async fn scripts_per_fresh_call_replay_and_run_of_replays() {
    let Some(server) = OwnServer::start("scripts_per_fresh_call_replay_and_run_of_replays").await
    else {
        return;
    };
    let idem = server.idem_uncached().await;
    let call = |key: &'static str| {
        let idem = idem.clone();
        async move {
            idem.operation("send", key)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async { Ok::<_, IdemError>(7u32) })
                .await
                .unwrap()
        }
    };
    // Loads the scripts, so the counts below are the steady state.
    call("warm").await;
    server.scripts_run().await;

    assert_eq!(call("k").await, 7);
    assert_eq!(
        server.scripts_run().await,
        2,
        "a fresh call: claim and record"
    );
    assert_eq!(call("k").await, 7);
    assert_eq!(
        server.commands_run().await,
        (1, 1),
        "a replay after fresh calls: the claim alone (its own HMGET inside)"
    );
    for _ in 0..5 {
        assert_eq!(call("k").await, 7);
    }
    assert_eq!(
        server.commands_run().await,
        (0, 5),
        "a run of replays: one HMGET each, no script"
    );
    let mismatch = idem
        .operation("send", "k")
        .fingerprint(&1u8)
        .retain(std::time::Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(8u32) })
        .await;
    assert!(
        matches!(mismatch, Err(IdemError::Mismatch { .. })),
        "{mismatch:?}"
    );
    assert_eq!(server.commands_run().await, (0, 1), "a mismatch read too");

    // A record past its retention (Redis keeps it a while longer) is no replay for the
    // read either: the claim takes it over and the body runs again.
    let runs = common::Counter::default();
    let call = |key, retain| common::counted_call(&idem, "send", key, retain, &runs, 9);
    // Within its retention it replays: kept a minute, so no delay can expire it first.
    let kept = || call("kept", Duration::from_secs(60));
    assert_eq!(kept().await.unwrap(), 9);
    assert_eq!(kept().await.unwrap(), 9);
    assert_eq!(runs.get(), 1);
    // Past it the body runs again (a later call, all the more).
    let brief = || call("brief", Duration::from_millis(300));
    assert_eq!(brief().await.unwrap(), 9);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(brief().await.unwrap(), 9);
    assert_eq!(runs.get(), 3, "an expired record replayed");
}

/// With the replay cache on (the default), a replay of an outcome this process recorded
/// a moment ago reaches no server at all.
#[tokio::test]
async fn a_replay_from_the_replay_cache_sends_nothing() {
    let Some(server) = OwnServer::start("a_replay_from_the_replay_cache_sends_nothing").await
    else {
        return;
    };
    let idem = Idem::builder().redis(&server.url).await.unwrap();
    let runs = common::Counter::default();
    let day = std::time::Duration::from_secs(86_400);
    let call = || common::counted_call(&idem, "send", "k", day, &runs, 7);
    assert_eq!(call().await.unwrap(), 7);
    server.commands_run().await;
    for _ in 0..3 {
        assert_eq!(call().await.unwrap(), 7);
    }
    assert_eq!(
        server.commands_run().await,
        (0, 0),
        "replays went to the server"
    );
    assert_eq!(runs.get(), 1, "a replay ran the body");
}

/// A replay cache entry lives `retain` from the claim's send, not the record's: a body
/// that outlasts `retain` leaves no entry, so the replay that follows asks the server,
/// whose record (kept `retain` from the write) decides.
#[tokio::test]
async fn a_cached_outcome_lives_retain_from_the_claim() {
    let Some(server) = OwnServer::start("a_cached_outcome_lives_retain_from_the_claim").await
    else {
        return;
    };
    let idem = Idem::builder().redis(&server.url).await.unwrap();
    let call = |pause: Duration| {
        idem.operation("send", "k")
            .retain(Duration::from_millis(500))
            .fingerprint_none()
            .run(move || async move {
                tokio::time::sleep(pause).await;
                Ok::<_, IdemError>(7u32)
            })
    };
    assert_eq!(call(Duration::from_millis(700)).await.unwrap(), 7);
    server.commands_run().await;
    call(Duration::ZERO).await.unwrap();
    assert_ne!(
        server.commands_run().await,
        (0, 0),
        "the cache answered past `retain` from the claim"
    );
}

/// A fresh claim's epoch is the server's `TIME`, so the record that follows reads no
/// clock of its own: the process hands it the retention deadline, from the least the
/// server's clock can read, which lies between the server's clock before the claim and
/// after the record, plus `retain`.
#[tokio::test]
async fn a_fresh_call_reads_the_servers_clock_once() {
    let Some(server) = OwnServer::start("a_fresh_call_reads_the_servers_clock_once").await else {
        return;
    };
    let idem = server.idem_uncached().await;
    let client = redis::Client::open(server.url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let server_ms = |mut c: redis::aio::MultiplexedConnection| async move {
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut c).await.unwrap();
        secs * 1000 + micros / 1000
    };
    let retain = Duration::from_secs(86_400);
    let call = |key: &'static str| {
        idem.operation("send", key)
            .retain(retain)
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(7u32) })
    };
    // Loads the scripts.
    call("warm").await.unwrap();
    common::redis_command_calls(&server.url).await;
    // A record sent over a second after its claim (a stalled test machine) reads `TIME`
    // itself; of three fresh calls, one is enough to tell.
    let mut spared = None;
    for key in ["k1", "k2", "k3"] {
        let existing = common::scan_keys(&mut c, "*").await.unwrap();
        let before = server_ms(c.clone()).await;
        assert_eq!(call(key).await.unwrap(), 7);
        let after = server_ms(c.clone()).await;
        let calls = common::redis_command_calls(&server.url).await;
        let times = calls
            .iter()
            .find(|(n, _)| n == "time")
            .map_or(0, |(_, n)| *n);
        // The two `TIME`s of this test, and the claim's.
        if times == 3 {
            spared = Some((existing, before, after));
            break;
        }
        assert_eq!(times, 4, "{calls:?}");
    }
    let (existing, before, after) =
        spared.expect("each of three fresh calls' records read the server's clock");

    // The record is the key that call added.
    let added: Vec<String> = common::scan_keys(&mut c, "*")
        .await
        .unwrap()
        .into_iter()
        .filter(|k| !existing.contains(k))
        .collect();
    let [record] = &added[..] else {
        panic!("one key added by the call: {added:?}");
    };
    let xa: i64 = redis::cmd("HGET")
        .arg(record)
        .arg("xa")
        .query_async(&mut c)
        .await
        .unwrap();
    let ttl: i64 = redis::cmd("PTTL")
        .arg(record)
        .query_async(&mut c)
        .await
        .unwrap();
    let retain_ms = retain.as_millis() as i64;
    assert!(
        xa >= before + retain_ms && xa <= after + retain_ms,
        "deadline {xa} outside [{before}, {after}] + retain"
    );
    let grace = 5 * 60 * 1000;
    assert!(ttl > grace && ttl <= retain_ms + grace, "TTL {ttl}");
}

/// A `hash_keys` secret shorter than 16 bytes is refused on Redis as on every store,
/// before anything is opened; a long enough one opens.
#[tokio::test]
async fn a_short_hash_keys_secret_is_refused() {
    let refused = |r: Result<Idem, IdemError>| match r {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("`hash_keys` secret"), "{message}")
        }
        other => panic!("expected a Config error, got {other:?}"),
    };
    refused(
        Idem::builder()
            .hash_keys(b"short")
            .redis(&common::redis_url())
            .await,
    );
    refused(
        Idem::builder()
            .hash_keys(b"fifteen bytes..")
            .redis_cluster(&["redis://127.0.0.1:1"])
            .await,
    );
    let test = "a_short_hash_keys_secret_is_refused";
    if common::redis_skip(test).is_some() {
        return;
    }
    Idem::builder()
        .hash_keys(b"sixteen bytes...")
        .key_prefix(common::unique_prefix(test))
        .redis(&common::redis_url())
        .await
        .unwrap();
}

/// A prefix keeps its key mode, as a SQL table does: opened once with `hash_keys`, it
/// refuses an open without them, or with another secret, with a `Config` error naming
/// both modes and what to do, instead of treating one operation as two and running its
/// body again.
#[tokio::test]
async fn a_prefix_keeps_its_key_mode() {
    let test = "a_prefix_keeps_its_key_mode";
    if common::redis_skip(test).is_some() {
        return;
    }
    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    let prefix = common::unique_prefix(test);
    let url = common::redis_url();
    let open = |secret: Option<&'static [u8]>| {
        let builder = Idem::builder().key_prefix(prefix.clone());
        let builder = match secret {
            Some(secret) => builder.hash_keys(secret),
            None => builder,
        };
        builder.redis(&url)
    };
    let runs = common::Counter::default();
    let retain = Duration::from_secs(60);
    let hashed = open(Some(SECRET)).await.unwrap();
    common::counted_call(&hashed, "email", "bob", retain, &runs, 1)
        .await
        .unwrap();

    let refused = |opened: Result<Idem, IdemError>, found: &str, wanted: &str| match opened {
        Err(IdemError::Config { message }) => {
            for part in [prefix.as_str(), found, wanted, "same `hash_keys` setting"] {
                assert!(message.contains(part), "`{part}` missing: {message}");
            }
        }
        Ok(_) => panic!("opened in another key mode; one operation would run twice"),
        Err(e) => panic!("expected a Config error, got {e:?}"),
    };
    refused(
        open(None).await,
        "keyed-hashed with the secret",
        "as given (no `hash_keys`)",
    );
    refused(
        open(Some(b"another secret of 32 bytes......")).await,
        "keyed-hashed with the secret",
        "keyed-hashed with the secret",
    );
    let again = open(Some(SECRET)).await.unwrap();
    let replayed = common::counted_call(&again, "email", "bob", retain, &runs, 2).await;
    assert_eq!(
        replayed.unwrap(),
        1,
        "the same secret finds the same operation"
    );
    assert_eq!(runs.get(), 1);
    common::Cleanup::for_redis_prefix(&prefix).run().await;

    // A prefix first opened without hashing refuses `hash_keys` the same way.
    let prefix = common::unique_prefix(test);
    let plain = Idem::builder().key_prefix(prefix.clone());
    plain.redis(&common::redis_url()).await.unwrap();
    let hashed = Idem::builder().key_prefix(prefix.clone()).hash_keys(SECRET);
    match hashed.redis(&common::redis_url()).await {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("as given (no `hash_keys`)"), "{message}")
        }
        other => panic!("expected a Config error, got {other:?}"),
    }
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

/// The steps key on the server: none for an operation without steps; no expiry while
/// its record is in progress; gone with the record's completion and with `forget`;
/// kept by a release, which leaves the record released (`st` 2) with a lapsed lease;
/// and a key left from an earlier life is neither listed nor added to, but replaced by
/// the first step of the new one.
#[tokio::test]
async fn the_steps_key_lives_and_goes_with_its_record() {
    use idem_runtime::store::redis::RedisStore;
    use idem_runtime::store::{Admin, Claim, ClaimRequest, Fence, Store, StoredOutcome};
    use idem_runtime::{OperationId, Takeover};

    let test = "the_steps_key_lives_and_goes_with_its_record";
    if common::redis_skip(test).is_some() {
        return;
    }
    let prefix = common::unique_prefix(test);
    let store = RedisStore::connect(&common::redis_url(), &prefix)
        .await
        .expect("connect");
    let client = redis::Client::open(common::redis_url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let id = |key: &str| OperationId {
        scope: String::new(),
        name: "op".into(),
        key: key.into(),
    };
    let value = |body: &str| StoredOutcome::new(body.as_bytes().to_vec(), false, 1);
    let claim = async |id: &OperationId| {
        let req = ClaimRequest {
            id,
            fingerprint: [1; 32],
            lease: Duration::from_secs(60),
            on_takeover: Takeover::Rerun,
        };
        match store.claim(&req).await.unwrap() {
            Claim::Acquired { epoch, .. } => epoch,
            other => panic!("{id}: {other:?}"),
        }
    };
    // The keys of the record the store keeps for `key`: its record and its steps.
    let keys_of = async |key: &str| {
        let (mut c, recs) = common::redis_record_keys(&prefix).await;
        for rec in recs {
            let k: Option<String> = redis::cmd("HGET")
                .arg(&rec)
                .arg("k")
                .query_async(&mut c)
                .await
                .unwrap();
            if k.as_deref() == Some(key) {
                let steps = rec.replacen(":r:{", ":s:{", 1);
                return (rec, steps);
            }
        }
        panic!("no record for {key}");
    };
    let conn = c.clone();
    let exists = async |key: &str| -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query_async::<i64>(&mut conn.clone())
            .await
            .unwrap()
            == 1
    };
    let all_steps_keys = async || {
        let pattern = format!("{prefix}:s:*");
        common::scan_keys(&mut conn.clone(), &pattern)
            .await
            .unwrap()
    };
    let hour = Duration::from_secs(3600);

    // No steps: no steps key, before or after the record.
    let plain = id("plain");
    let epoch = claim(&plain).await;
    // A fresh claim writes no claim time or lease deadline of its own: `get` derives
    // both from its epoch and its lease.
    let detail = store.get(&plain).await.unwrap().expect("claimed");
    let lease = Duration::from_secs(60) + Duration::from_millis(2);
    assert!(
        detail.info.age < hour
            && detail
                .lease_remaining
                .is_some_and(|l| l > Duration::ZERO && l <= lease),
        "{detail:?}"
    );
    let rec = store.record(&plain, epoch, &value("1"), hour).await;
    assert_eq!(rec.unwrap(), Fence::Held);
    assert!(
        all_steps_keys().await.is_empty(),
        "an operation without steps"
    );

    // Steps: a key without expiry while in progress, gone with the completion.
    let done = id("done");
    let epoch = claim(&done).await;
    for label in ["a", "b"] {
        let put = store.record_step(&done, epoch, label, &value("2")).await;
        assert_eq!(put.unwrap(), Fence::Held);
    }
    let (rec, steps) = keys_of("done").await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&steps)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(pttl, -1, "steps of a claim in progress never expire");
    let put = store.record(&done, epoch, &value("3"), hour).await;
    assert_eq!(put.unwrap(), Fence::Held);
    assert!(exists(&rec).await);
    assert!(!exists(&steps).await, "a completion drops the steps");

    // A release keeps record and steps; `forget` drops both.
    let kept = id("kept");
    let epoch = claim(&kept).await;
    let put = store.record_step(&kept, epoch, "a", &value("4")).await;
    assert_eq!(put.unwrap(), Fence::Held);
    assert_eq!(
        store
            .release(&kept, epoch, Duration::from_secs(86_400))
            .await
            .unwrap(),
        Fence::Held
    );
    let (rec, steps) = keys_of("kept").await;
    let st: Option<String> = redis::cmd("HGET")
        .arg(&rec)
        .arg("st")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(st.as_deref(), Some("2"), "released with its steps");
    assert!(exists(&steps).await);
    let detail = store.get(&kept).await.unwrap().expect("kept");
    assert_eq!(detail.lease_remaining, Some(Duration::ZERO));
    assert_eq!(store.forget(&kept, epoch).await.unwrap(), Fence::Held);
    assert!(!exists(&rec).await && !exists(&steps).await, "forgotten");

    // A steps key left from an earlier life: not listed, replaced by the first step.
    let stale = id("stale");
    let epoch = claim(&stale).await;
    let (_, steps) = keys_of("stale").await;
    let _: () = redis::cmd("HSET")
        .arg(&steps)
        .arg("old")
        .arg("1:1:0:0:1:5")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(store.steps(&stale).await.unwrap().is_empty());
    let put = store.record_step(&stale, epoch, "new", &value("6")).await;
    assert_eq!(put.unwrap(), Fence::Held);
    let listed = store.steps(&stale).await.unwrap();
    let labels: Vec<_> = listed.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["new"]);
    assert_eq!((listed[0].epoch, &listed[0].outcome), (epoch, &value("6")));
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}

/// Replays read the record with `HMGET` alone while a recent `TIME` bounds the server's
/// clock, carried forward by this process's: a record whose retention ended since that
/// `TIME` is not replayed, and its key runs again.
#[tokio::test]
async fn a_replay_read_past_retention_runs_again() {
    let test = "a_replay_read_past_retention_runs_again";
    if common::redis_skip(test).is_some() {
        return;
    }
    let prefix = common::unique_prefix(test);
    let idem = uncached(&common::redis_url(), Some(&prefix)).await;
    let runs = common::Counter::default();
    let retain = Duration::from_millis(300);
    let call = || {
        let runs = runs.clone();
        idem.operation("charge", "o-1")
            .retain(retain)
            .fingerprint(&7)
            .run(move || async move {
                runs.hit();
                Ok::<_, IdemError>(7)
            })
    };
    assert_eq!(call().await.unwrap(), 7);
    // Replays: the first, through the claim, opens the replay read; the next reads
    // with `TIME`, the rest without.
    for _ in 0..4 {
        assert_eq!(call().await.unwrap(), 7);
    }
    assert_eq!(runs.get(), 1);
    // Past retention, within a second of the last `TIME`.
    tokio::time::sleep(retain + Duration::from_millis(100)).await;
    assert_eq!(call().await.unwrap(), 7);
    assert_eq!(runs.get(), 2, "replayed past its retention");
    common::Cleanup::for_redis_prefix(&prefix).run().await;
}
