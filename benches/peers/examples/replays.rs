//! 16 callers replaying recorded keys on Redis, through idem or the peer, for a
//! profiler: the bench's "replay ×16" row on its own.
//!
//! ```text
//! cargo build --release --manifest-path benches/peers/Cargo.toml --example replays
//! taskset -c 0 perf record -g --call-graph dwarf \
//!     "${CARGO_TARGET_DIR:-benches/peers/target}/release/examples/replays" idem 4
//! ```
//!
//! Arguments: `idem` or `idempotent`, the seconds to run (default 10), then `fresh` for
//! fresh calls instead of replays, and the number of callers (default 16). The server
//! is `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`); run it on the other core.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_peer_bench::{Res, Size, idem_call, peer_call_sized};
use idem_runtime::Idem;
use idempotent::store::valkey::ValkeyStore;

/// Keys recorded first, then replayed in turn.
const KEYS: u64 = 1000;

const CALLERS: usize = 16;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "idem".into());
    let secs: f64 = args.next().map_or(Ok(10.0), |s| s.parse())?;
    // `fresh`: every call on a key of its own, no replays; then the number of callers.
    let fresh = args.next().is_some_and(|a| a == "fresh");
    let callers: usize = args.next().map_or(Ok(CALLERS), |s| s.parse())?;
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let idem = Idem::builder()
        .key_prefix("idem-replays")
        .replay_cache_bytes(0)
        .redis(&url)
        .await?;
    let peer = Arc::new(
        ValkeyStore::with_prefix(redis::Client::open(url.as_str())?, Some("replays")).await?,
    );
    let call = move |k: u64| {
        let (idem, peer, which) = (idem.clone(), peer.clone(), which.clone());
        async move {
            match which.as_str() {
                "idem" => idem_call(&idem, k).await,
                "idempotent" => peer_call_sized(&*peer, k, Size::Small).await,
                other => Err(format!("`{other}`: say idem or idempotent").into()),
            }
        }
    };
    // Fresh keys start past any earlier run's.
    let first = if fresh {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_micros() as u64
    } else {
        for k in 0..KEYS {
            call(k).await?;
        }
        0
    };
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..callers {
        let (call, done) = (call.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let n = done.fetch_add(1, Ordering::Relaxed);
                call(if fresh { first + n } else { n % KEYS }).await?;
            }
            Res::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    println!(
        "{:.0} {}/s",
        done.load(Ordering::Relaxed) as f64 / secs,
        if fresh { "fresh calls" } else { "replays" }
    );
    Ok(())
}
