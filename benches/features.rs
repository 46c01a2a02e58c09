//! The cost of two of idem's options, each beside the same calls without it:
//!
//! - a claim limit (`IdemBuilder::limit_new_claims`), with an allowance no call uses up,
//!   for one caller's fresh calls and replays: counted per process on the memory store
//!   and on PostgreSQL, and shared through PostgreSQL and Redis (one statement or script
//!   more per new claim, and the replay read before every claim);
//! - the client layer (`client::PropagateKeyLayer`) on a tower service that answers at
//!   once, called from inside an idempotent body, against the same service bare.
//!
//! Each row is the median of the rounds, the two subjects alternating within each round.
//! `IDEM_BENCH_CALLS` (calls per measurement in process, default 20000; a twentieth of
//! it on a server) and `IDEM_BENCH_ROUNDS` (default 3). PostgreSQL and Redis rows need
//! the services (`IDEM_POSTGRES_URL`, `IDEM_REDIS_URL`); a row whose server is down is
//! left out. The tables `idem_bench_features_*` and the Redis prefixes
//! `idem-bench-features-*` are kept between runs, each run on keys of its own.
//!
//! `cargo bench -p idem-tests --bench features`

use std::time::{Duration, Instant};

use axum::http;
use idem_runtime::client::PropagateKeyLayer;
use idem_runtime::{ClaimLimit, Idem, IdemBuilder, IdemError};
use tower::{Layer, Service, ServiceExt};

#[path = "support/knobs.rs"]
mod knobs;
use knobs::{env, median};

const DAY: Duration = Duration::from_secs(86_400);

/// An allowance no run of this bench uses up: what is measured is the counting.
fn generous() -> ClaimLimit {
    ClaimLimit::new(u32::MAX, Duration::from_nanos(1))
}

/// Microseconds per call of `calls` calls with keys `from..from + calls`.
async fn per_call(idem: &Idem, from: u64, calls: usize) -> f64 {
    let started = Instant::now();
    for i in from..from + calls as u64 {
        idem.operation("charge", &i)
            .scope("tenant-1")
            .retain(DAY)
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(1999u64) })
            .await
            .unwrap();
    }
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

/// Opens a store with a builder, under a tag of its own; `None` if it is down.
type Opener = dyn Fn(IdemBuilder, &str) -> futures_util::future::BoxFuture<'static, Option<Idem>>;

/// A store to open twice: without the option and with it.
struct Subject {
    name: &'static str,
    calls: usize,
    open: Box<Opener>,
}

fn memory() -> Subject {
    Subject {
        name: "memory",
        calls: 1,
        open: Box::new(|b, _| Box::pin(async move { Some(b.memory()) })),
    }
}

fn postgres() -> Subject {
    Subject {
        name: "PostgreSQL",
        calls: 20,
        open: Box::new(|b, tag| {
            let url = idem_test_support::postgres_url();
            let table = format!("idem_bench_features_{tag}");
            Box::pin(async move { b.table(table).postgres(&url).await.ok() })
        }),
    }
}

fn redis() -> Subject {
    Subject {
        name: "Redis",
        calls: 20,
        open: Box::new(|b, tag| {
            let url = idem_test_support::redis_url();
            let prefix = format!("idem-bench-features-{tag}");
            Box::pin(async move { b.key_prefix(prefix).redis(&url).await.ok() })
        }),
    }
}

async fn limit_rows(calls: usize, rounds: usize) {
    println!("| store | limit | call | no limit µs/call | limited µs/call | cost |");
    println!("|---|---|---|---:|---:|---:|");
    let cases = [
        (memory(), "per process", false),
        (postgres(), "per process", false),
        (postgres(), "shared", true),
        (redis(), "shared", true),
    ];
    for (n, (subject, kind, shared)) in cases.into_iter().enumerate() {
        let limit = if shared {
            generous().shared()
        } else {
            generous()
        };
        let base = Idem::builder().replay_cache_bytes(0);
        let plain = (subject.open)(base.clone(), &format!("{n}plain")).await;
        let limited = (subject.open)(base.limit_new_claims(limit), &format!("{n}limited")).await;
        let (Some(plain), Some(limited)) = (plain, limited) else {
            eprintln!("{}: not reachable; its rows are left out", subject.name);
            continue;
        };
        let n = (calls / subject.calls).max(1);
        let (mut fresh, mut replay) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
        // Keys no earlier run used: the tables and prefixes are kept between runs.
        let run = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
            * 1000;
        for round in 0..rounds {
            let from = run + (round * n) as u64;
            for (s, idem) in [&plain, &limited].into_iter().enumerate() {
                fresh[s].push(per_call(idem, from, n).await);
            }
            for (s, idem) in [&plain, &limited].into_iter().enumerate() {
                replay[s].push(per_call(idem, from, n).await);
            }
        }
        for (call, [without, with]) in [("fresh", fresh), ("replay", replay)] {
            let (without, with) = (median(without), median(with));
            println!(
                "| {} | {kind} | {call} | {without:.2} | {with:.2} | {:+.2} µs ({:+.0}%) |",
                subject.name,
                with - without,
                (with / without - 1.0) * 100.0
            );
        }
    }
}

/// Microseconds per request through `svc`, `calls` of them inside one idempotent body.
async fn per_request<S>(idem: &Idem, key: u64, svc: S, calls: usize) -> f64
where
    S: Service<http::Request<String>, Response = http::Response<String>> + Clone,
    S::Error: std::fmt::Debug,
{
    idem.operation("call", &key)
        .retain(DAY)
        .fingerprint_none()
        .run(|| async move {
            let started = Instant::now();
            for _ in 0..calls {
                let req = http::Request::post("http://127.0.0.1/charges")
                    .body(String::new())
                    .unwrap();
                let res = svc.clone().oneshot(req).await.unwrap();
                assert_eq!(res.status(), 200);
            }
            Ok::<_, IdemError>(started.elapsed().as_secs_f64() * 1e6 / calls as f64)
        })
        .await
        .unwrap()
}

async fn client_rows(calls: usize, rounds: usize) {
    let service = tower::service_fn(|req: http::Request<String>| async move {
        // What a downstream would read: the key, when there is one.
        let keyed = req.headers().contains_key("idempotency-key");
        Ok::<_, std::convert::Infallible>(http::Response::new(keyed.to_string()))
    });
    let layered = PropagateKeyLayer::new().layer(service);
    let idem = Idem::memory();
    let (mut bare, mut with) = (Vec::new(), Vec::new());
    for round in 0..rounds as u64 {
        bare.push(per_request(&idem, 2 * round, service, calls).await);
        with.push(per_request(&idem, 2 * round + 1, layered.clone(), calls).await);
    }
    let (bare, with) = (median(bare), median(with));
    println!();
    println!("| requests | bare µs/request | through the layer µs/request | cost |");
    println!("|---|---:|---:|---:|");
    println!(
        "| POST inside a body | {bare:.3} | {with:.3} | {:+.3} µs ({:+.0}%) |",
        with - bare,
        (with / bare - 1.0) * 100.0
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let calls = env("IDEM_BENCH_CALLS", 20_000);
    let rounds = env("IDEM_BENCH_ROUNDS", 3).max(1);
    limit_rows(calls, rounds).await;
    client_rows(calls, rounds).await;
}
