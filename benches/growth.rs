//! Throughput as the table grows, on PostgreSQL: fresh calls and replays at 16 callers
//! through `Idem::postgres` with 10⁴, 10⁵ and 10⁶ completed records in its table, each
//! size measured right after the table reached it, as a ratio to the smallest.
//!
//! `cargo bench -p idem-tests --bench growth` (PostgreSQL at `IDEM_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`). `IDEM_BENCH_SECS` sets one measurement's
//! length (default 2); `IDEM_BENCH_GROWTH_MAX` the largest size (default 10⁶; 10⁷ wants
//! about 10 GB of free disk).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "support/fill.rs"]
mod fill;
use fill::{drop_idem_table, env_or, fill};

const CALLERS: u64 = 16;
/// Keys each size's replays cycle over at most (recorded by that size's fresh calls).
const REPLAY_KEYS: u64 = 2000;

/// Calls `op(i)` for i = 0, 1, ... on `CALLERS` tasks for `secs`; the calls made, and
/// operations per second.
async fn drive<F, Fut>(secs: f64, op: F) -> Res<(u64, f64)>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<u32, IdemError>> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let tasks: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (op, next) = (op.clone(), next.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                while Instant::now() < deadline {
                    let got = op(next.fetch_add(1, Ordering::Relaxed)).await?;
                    assert_eq!(got, 1, "another outcome");
                    done += 1;
                }
                Ok::<_, IdemError>(done)
            })
        })
        .collect();
    let mut done = 0;
    for task in tasks {
        done += task.await??;
    }
    Ok((done, done as f64 / start.elapsed().as_secs_f64()))
}

/// A call under `key` whose body returns 1.
async fn call(idem: Idem, key: String) -> Result<u32, IdemError> {
    idem.operation("bench", &key)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(1u32) })
        .await
}

#[tokio::main]
async fn main() -> Res<()> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let secs = std::env::var("IDEM_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2.0);
    let max = env_or("IDEM_BENCH_GROWTH_MAX", 1_000_000);
    let table = format!("idem_bench_growth_{}", std::process::id());
    // The replay cache off: every replay reaches the table.
    let idem = Idem::builder()
        .table(&table)
        .replay_cache_bytes(0)
        .postgres(&url)
        .await?;
    let pool = sqlx::PgPool::connect(&url).await?;
    let result = run(&idem, &pool, &table, secs, max).await;
    drop_idem_table(&pool, &table).await?;
    result
}

async fn run(idem: &Idem, pool: &sqlx::PgPool, table: &str, secs: f64, max: i64) -> Res<()> {
    let mut rows = Vec::new();
    let mut filled = 0;
    let mut size = 10_000;
    while size <= max {
        fill(
            pool,
            table,
            filled + 1,
            size - filled,
            "now() + interval '1 day'",
        )
        .await?;
        filled = size;
        let (made, fresh) = {
            let idem = idem.clone();
            drive(secs, move |i| call(idem.clone(), format!("s{size}-{i}"))).await?
        };
        // Only keys the fresh calls recorded (every call the drive counted completed).
        let keys = made.min(REPLAY_KEYS);
        let (_, replay) = {
            let idem = idem.clone();
            drive(secs, move |i| {
                call(idem.clone(), format!("s{size}-{}", i % keys))
            })
            .await?
        };
        rows.push((size, fresh, replay));
        size *= 10;
    }
    println!("throughput as the table grows (PostgreSQL, Idem::postgres, {CALLERS} callers)");
    println!("| completed records | fresh ops/s | vs first | replay ops/s | vs first |");
    println!("|---:|---:|---:|---:|---:|");
    let (_, f0, r0) = rows[0];
    for (size, fresh, replay) in rows {
        println!(
            "| {size} | {fresh:.0} | {:.2} | {replay:.0} | {:.2} |",
            fresh / f0,
            replay / r0
        );
    }
    Ok(())
}
