//! The cost of encrypted outcomes (`IdemBuilder::encrypt`): one caller's fresh calls and
//! replays of a small (about 40 bytes of JSON) and a 4 KiB outcome, encrypted and in
//! clear, on the memory store and on a SQLite file (WAL, `synchronous=FULL`, no replay
//! cache, so every replay reads the store and opens the body). Each row is the median of
//! the rounds, the clear and encrypted subjects alternating within each round.
//!
//! `IDEM_BENCH_CALLS` (calls per measurement on the memory store, default 20000; a tenth
//! of it on SQLite for fresh calls) and `IDEM_BENCH_ROUNDS` (default 3).
//!
//! `cargo bench -p idem-tests --bench encryption`

use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError, Keyring};

#[path = "support/knobs.rs"]
mod knobs;
use knobs::{env, median};

const DAY: Duration = Duration::from_secs(86_400);

#[derive(Clone, Copy, PartialEq)]
enum Store {
    Memory,
    Sqlite,
}

async fn open(store: Store, encrypted: bool, dir: &std::path::Path, n: usize) -> Idem {
    let b = Idem::builder().replay_cache_bytes(0);
    let b = if encrypted {
        b.encrypt(Keyring::new("bench", [0x5a; 32]).unwrap())
    } else {
        b
    };
    match store {
        Store::Memory => b.memory(),
        Store::Sqlite => {
            let path = dir.join(format!("bench-{encrypted}-{n}.db"));
            b.sqlite(&format!("sqlite://{}?mode=rwc", path.display()))
                .await
                .unwrap()
        }
    }
}

/// Microseconds per call of `calls` calls with keys `from..from + calls`, each returning
/// `outcome`.
async fn per_call(idem: &Idem, outcome: &str, from: u64, calls: usize) -> f64 {
    let started = Instant::now();
    for i in from..from + calls as u64 {
        let out = idem
            .operation("charge", &i)
            .retain(DAY)
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(outcome.to_owned()) })
            .await
            .unwrap();
        assert_eq!(out.len(), outcome.len());
    }
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let calls = env("IDEM_BENCH_CALLS", 20_000);
    let rounds = env("IDEM_BENCH_ROUNDS", 3).max(1);
    let dir = tempfile::tempdir().unwrap();
    let small = "receipt ch_3MqL2x card 4242 cents 1999".to_owned();
    let big = "x".repeat(4096 - 2); // 4096 bytes of JSON with its quotes
    println!("| store | outcome | call | clear µs/call | encrypted µs/call | cost |");
    println!("|---|---|---|---|---|---|");
    for store in [Store::Memory, Store::Sqlite] {
        let n = match store {
            Store::Memory => calls,
            Store::Sqlite => (calls / 10).max(1),
        };
        for (label, outcome) in [("small", &small), ("4 KiB", &big)] {
            // Per subject: the fresh calls of each round, then their replays.
            let mut fresh = [Vec::new(), Vec::new()];
            let mut replay = [Vec::new(), Vec::new()];
            let idems = [
                open(store, false, dir.path(), outcome.len()).await,
                open(store, true, dir.path(), outcome.len()).await,
            ];
            for round in 0..rounds {
                let from = (round * n) as u64;
                for (s, idem) in idems.iter().enumerate() {
                    fresh[s].push(per_call(idem, outcome, from, n).await);
                }
                for (s, idem) in idems.iter().enumerate() {
                    replay[s].push(per_call(idem, outcome, from, n).await);
                }
            }
            let name = match store {
                Store::Memory => "memory",
                Store::Sqlite => "SQLite",
            };
            for (call, [clear, sealed]) in [("fresh", fresh), ("replay", replay)] {
                let (clear, sealed) = (median(clear), median(sealed));
                println!(
                    "| {name} | {label} | {call} | {clear:.2} | {sealed:.2} | {:+.2} µs ({:+.0}%) |",
                    sealed - clear,
                    (sealed / clear - 1.0) * 100.0
                );
            }
        }
    }
}
