//! Network faults between idem and its store, made by a TCP proxy: no call hangs under
//! a partition, a record whose reply is lost is reported `Unrecorded`, a reset after a
//! commit is retried idempotently, and a finisher cut off past its lease is fenced.
//!
//! Every test runs under an outer bound, so a regression fails instead of hanging.
use crate::common;
use crate::proxy;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::{Idem, IdemBuilder, IdemError, InFlight};
use proxy::{Mode, Proxy};

/// Short, so the partitions below are over in seconds.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);
const LEASE: Duration = Duration::from_secs(2);
/// No test may take longer than this, whatever breaks.
const OUTER: Duration = Duration::from_secs(25);

#[derive(Clone, Copy, Debug)]
enum Net {
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    MySql,
    Redis,
}

/// A store reached through the proxy, and the same records reached directly.
struct Through {
    proxy: Proxy,
    idem: Idem,
    direct: Idem,
    cleanup: common::Cleanup,
}

/// `url` with its host and port replaced by the proxy's, and the upstream it named.
fn via(url: &str, default_port: u16, port: u16) -> (String, String) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    let authority = &url[start..end];
    let (user, host) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let upstream = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{default_port}")
    };
    let proxied = format!("{}{user}127.0.0.1:{port}{}", &url[..start], &url[end..]);
    (upstream, proxied)
}

async fn through(net: Net, test: &str, opts: fn(IdemBuilder) -> IdemBuilder) -> Option<Through> {
    let (skipped, url, default_port) = match net {
        #[cfg(feature = "postgres")]
        Net::Postgres => (common::postgres_skip(test), common::postgres_url(), 5432),
        #[cfg(feature = "mysql")]
        Net::MySql => (common::mysql_skip(test), common::mysql_url(), 3306),
        Net::Redis => (common::redis_skip(test), common::redis_url(), 6379),
    };
    if skipped.is_some() {
        return None;
    }
    let (upstream, _) = via(&url, default_port, 0);
    let proxy = Proxy::start(&upstream).await;
    let (_, proxied) = via(&url, default_port, proxy.port);
    // One table (or key prefix), reached directly and through the proxy.
    let place = match net {
        Net::Redis => common::unique_prefix(test),
        #[allow(unreachable_patterns)]
        _ => common::unique_table(test),
    };
    let open = |url: String| {
        let (builder, place) = (opts(Idem::builder().store_timeout(STORE_TIMEOUT)), &place);
        async move {
            match net {
                #[cfg(feature = "postgres")]
                Net::Postgres => builder.table(place).postgres(&url).await,
                #[cfg(feature = "mysql")]
                Net::MySql => builder.table(place).mysql(&url).await,
                Net::Redis => builder.key_prefix(place).redis(&url).await,
            }
            .unwrap()
        }
    };
    let direct = open(url).await;
    let idem = open(proxied).await;
    let cleanup = match net {
        #[cfg(feature = "postgres")]
        Net::Postgres => common::Cleanup::for_table(&place),
        #[cfg(feature = "mysql")]
        Net::MySql => common::Cleanup::for_mysql_table(&place),
        Net::Redis => common::Cleanup::for_redis_prefix(&place),
    };
    Some(Through {
        proxy,
        idem,
        direct,
        cleanup,
    })
}

/// Instantiates each `async fn(&Through)` once per networked store.
macro_rules! net_suite {
    ($(($name:ident, $opts:expr)),* $(,)?) => {
        /// Latency is not an outage: a store timeout that a slow link's handshakes fit in.
fn patient(b: IdemBuilder) -> IdemBuilder {
    b.store_timeout(Duration::from_secs(15))
}

net_suite!(@one postgres Postgres [feature = "postgres"] ($(($name, $opts)),*));
        net_suite!(@one mysql MySql [feature = "mysql"] ($(($name, $opts)),*));
        net_suite!(@one redis Redis [] ($(($name, $opts)),*));
    };
    (@one $module:ident $net:ident [$($cfg:meta)?] ($(($name:ident, $opts:expr)),*)) => {
        $(#[cfg($cfg)])?
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let test = concat!("wire_", stringify!($module), "_", stringify!($name));
                    let Some(t) = super::through(super::Net::$net, test, $opts).await else {
                        return;
                    };
                    tokio::time::timeout(super::OUTER, super::$name(&t))
                        .await
                        .unwrap_or_else(|_| panic!("{test} hung past {:?}", super::OUTER));
                    t.cleanup.run().await;
                }
            )*
        }
    };
}

fn plain(b: IdemBuilder) -> IdemBuilder {
    b
}

/// Renewals off: the only statements after a body are its record's.
fn no_renewals(b: IdemBuilder) -> IdemBuilder {
    b.renew_leases(false)
}

/// Connections for claims and records on the SQL stores (Redis holds two whatever).
const POOL: u32 = 3;

/// A pool of [`POOL`] connections.
fn few_connections(b: IdemBuilder) -> IdemBuilder {
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    let b = b.max_connections(POOL);
    b
}

net_suite!(
    (a_claim_into_a_black_hole_fails_closed, super::plain),
    (a_record_into_a_black_hole_is_unrecorded, super::plain),
    (
        a_lost_record_reply_is_answered_and_the_record_stands,
        super::no_renewals
    ),
    (
        a_committed_record_whose_reply_was_lost_is_answered,
        super::no_renewals
    ),
    (
        a_reset_after_the_record_committed_is_retried,
        super::no_renewals
    ),
    (a_finisher_cut_off_past_its_lease_is_fenced, super::plain),
    (latency_keeps_one_execution_per_key, super::patient),
    (a_silenced_connection_is_not_reused, super::plain),
    (
        silenced_connections_are_replaced_within_a_few_calls,
        super::few_connections
    ),
);

fn op(idem: &Idem, key: &str) -> idem_runtime::Operation {
    idem.operation("wire", key)
        .retain(Duration::from_secs(3600))
        .fingerprint_none()
        .lease(LEASE)
}

async fn a_claim_into_a_black_hole_fails_closed(t: &Through) {
    // A warm connection first, so the partition meets an established one.
    op(&t.idem, "warm")
        .run(|| async { Ok::<_, IdemError>(0) })
        .await
        .unwrap();
    t.proxy.set(Mode::BlackHole);
    let runs = AtomicUsize::new(0);
    let r = op(&t.idem, "k")
        .run(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, IdemError>(1)
        })
        .await;
    t.proxy.set(Mode::Pass);
    assert!(
        matches!(&r, Err(e @ IdemError::Store { .. }) if e.is_retryable()),
        "{r:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the body ran without a claim"
    );
}

async fn a_record_into_a_black_hole_is_unrecorded(t: &Through) {
    let proxy = &t.proxy;
    let r = op(&t.idem, "k")
        .run(|| async {
            proxy.set(Mode::BlackHole);
            Ok::<_, IdemError>(1)
        })
        .await;
    proxy.set(Mode::Pass);
    assert!(matches!(&r, Err(IdemError::Unrecorded { .. })), "{r:?}");
}

async fn a_lost_record_reply_is_answered_and_the_record_stands(t: &Through) {
    let proxy = &t.proxy;
    let r = op(&t.idem, "k")
        .run(|| async {
            proxy.set(Mode::DropNextReply);
            Ok::<_, IdemError>(7)
        })
        .await;
    assert_eq!(proxy.mode(), Mode::Pass, "no reply was dropped");
    // Answered within the bound: a retried record that finds its own landed one, or
    // `Unrecorded` once the lease's window is spent. Never a hang.
    let landed = match &r {
        Ok(7) => true,
        Err(IdemError::Unrecorded { .. }) => false,
        other => panic!("{other:?}"),
    };
    // What was answered `Ok` is recorded: a retry replays it.
    let runs = AtomicUsize::new(0);
    let again = op(&t.direct, "k")
        .in_flight(InFlight::Wait(LEASE * 5))
        .run(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, IdemError>(8)
        })
        .await
        .unwrap();
    if landed {
        assert_eq!((again, runs.load(Ordering::SeqCst)), (7, 0));
    }
}

/// A record commits and its reply is lost, its connection left open and silent. The
/// record is retried on another connection within the lease, finds its own record,
/// and the call is answered with its outcome; a retry through the same store replays it.
async fn a_committed_record_whose_reply_was_lost_is_answered(t: &Through) {
    let proxy = &t.proxy;
    // A record first, so its statement is prepared on the connection and the next one
    // runs in one round trip: the reply dropped below is then a committed record's.
    op(&t.idem, "warm")
        .run(|| async { Ok::<_, IdemError>(0) })
        .await
        .unwrap();
    let first = op(&t.idem, "k")
        .run(|| async {
            proxy.set(Mode::DropNextReply);
            Ok::<_, IdemError>(7)
        })
        .await;
    assert_eq!(proxy.mode(), Mode::Pass, "no reply was dropped");
    // Whether the statement whose reply was dropped ran: a statement new to its
    // connection would wait for the reply that describes it.
    let landed = t.direct.stats().await.unwrap().completed == 2;
    match &first {
        Ok(7) => {}
        Err(IdemError::Unrecorded { .. }) if !landed => {}
        other => panic!("the record landed: {landed}; the call answered {other:?}"),
    }
    let runs = AtomicUsize::new(0);
    let again = op(&t.idem, "k")
        .in_flight(InFlight::Wait(LEASE * 5))
        .run(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, IdemError>(8)
        })
        .await;
    let again = again.unwrap_or_else(|e| panic!("the retry (landed: {landed}): {e:?}"));
    if landed {
        assert_eq!((again, runs.load(Ordering::SeqCst)), (7, 0), "not a replay");
    }
}

async fn a_reset_after_the_record_committed_is_retried(t: &Through) {
    let proxy = &t.proxy;
    let r = op(&t.idem, "k")
        .run(|| async {
            proxy.set(Mode::ResetNextReply);
            Ok::<_, IdemError>(7)
        })
        .await;
    assert_eq!(proxy.mode(), Mode::Pass, "no reply was reset");
    assert_eq!(r.unwrap(), 7, "the retried record is idempotent");
    let again = op(&t.direct, "k")
        .run(|| async { Ok::<_, IdemError>(8) })
        .await;
    assert_eq!(again.unwrap(), 7);
}

async fn a_finisher_cut_off_past_its_lease_is_fenced(t: &Through) {
    let (healed_tx, healed_rx) = tokio::sync::oneshot::channel::<()>();
    let (started, taken) = (tokio::sync::Notify::new(), tokio::sync::Notify::new());
    let proxy = &t.proxy;
    let first = op(&t.idem, "k").run(|| async {
        proxy.set(Mode::BlackHole);
        started.notify_one();
        // Cut off until another caller has taken the lapsed claim over.
        taken.notified().await;
        proxy.set(Mode::Pass);
        let _ = healed_tx.send(());
        Ok::<_, IdemError>(1)
    });
    let taker = async {
        started.notified().await;
        // The first's renewals cannot get through: its lease lapses and this takes over.
        let r = op(&t.direct, "k")
            .in_flight(InFlight::Wait(LEASE * 10))
            .run(|| async { Ok::<_, IdemError>(2) })
            .await;
        taken.notify_one();
        let _ = healed_rx.await;
        r
    };
    let (first, taker) = tokio::join!(first, taker);
    assert_eq!(taker.unwrap(), 2);
    assert!(matches!(&first, Err(IdemError::Fenced { .. })), "{first:?}");
    let again = op(&t.direct, "k")
        .run(|| async { Ok::<_, IdemError>(3) })
        .await;
    assert_eq!(again.unwrap(), 2, "the taker's outcome stands");
}

async fn latency_keeps_one_execution_per_key(t: &Through) {
    t.proxy.set(Mode::Delay(Duration::from_millis(10)));
    let runs: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
    let calls = (0..12).map(|i| {
        let runs = &runs;
        async move {
            let key = i % 3;
            op(&t.idem, &format!("k{key}"))
                .in_flight(InFlight::Wait(Duration::from_secs(15)))
                .run(|| async move {
                    runs[key].fetch_add(1, Ordering::SeqCst);
                    Ok::<_, IdemError>(key)
                })
                .await
        }
    });
    for (i, r) in futures_util::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        assert_eq!(r.unwrap(), i % 3);
    }
    t.proxy.set(Mode::Pass);
    let runs: Vec<usize> = runs.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    assert_eq!(runs, [1, 1, 1], "a key ran more than once under latency");
}

#[test]
fn urls_are_routed_through_the_proxy() {
    assert_eq!(
        via("postgres://postgres@127.0.0.1:5432/test", 5432, 9),
        (
            "127.0.0.1:5432".to_owned(),
            "postgres://postgres@127.0.0.1:9/test".to_owned()
        )
    );
    assert_eq!(
        via("redis://127.0.0.1", 6379, 9),
        (
            "127.0.0.1:6379".to_owned(),
            "redis://127.0.0.1:9".to_owned()
        )
    );
}

async fn a_silenced_connection_is_not_reused(t: &Through) {
    let proxy = &t.proxy;
    let _ = op(&t.idem, "k")
        .run(|| async {
            proxy.set(Mode::DropNextReply);
            Ok::<_, IdemError>(7)
        })
        .await;
    assert_eq!(proxy.mode(), Mode::Pass, "no reply was dropped");
    // The connection that lost a reply is silent for good; the next calls must not keep
    // using it. A call may meet it once (and time out), never every time.
    let mut answers = Vec::new();
    for i in 0..3 {
        let r = op(&t.idem, &format!("next-{i}"))
            .run(|| async { Ok::<_, IdemError>(i) })
            .await;
        answers.push(r.is_ok());
    }
    assert!(
        answers.iter().any(|ok| *ok),
        "every call met the silent connection: {answers:?}"
    );
}

/// Every connection idem holds goes silent while new ones would be answered. Each call
/// that meets a silent one times out, and its connection is closed then, so after at
/// most one failed call per connection (and a couple more for the connections the
/// store opens besides), a call opens a fresh one and succeeds. The lease is long, as a
/// real one is: a claim that timed out must not keep its connection for it.
async fn silenced_connections_are_replaced_within_a_few_calls(t: &Through) {
    let call = |key: String| async move {
        op(&t.idem, &key)
            .lease(Duration::from_secs(60))
            .run(|| async { Ok::<_, IdemError>(1) })
            .await
    };
    // Every connection open and idle: calls overlap while each round trip is slowed.
    t.proxy.set(Mode::Delay(Duration::from_millis(50)));
    let warm = (0..POOL * 3).map(|i| call(format!("warm-{i}")));
    for r in futures_util::future::join_all(warm).await {
        r.unwrap();
    }
    t.proxy.set(Mode::Pass);
    t.proxy.set(Mode::SilenceOpen);
    let most = POOL as usize + 2;
    let mut failed = Vec::new();
    loop {
        match call(format!("after-{}", failed.len())).await {
            Ok(_) => break,
            Err(e @ IdemError::Store { .. }) if e.is_retryable() => failed.push(e.to_string()),
            Err(e) => panic!("{e:?}"),
        }
        assert!(
            failed.len() <= most,
            "{} calls in a row failed on silent connections (at most {most} may): {failed:#?}",
            failed.len()
        );
    }
}
