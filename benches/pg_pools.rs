//! How idem's connections affect throughput on PostgreSQL: the same calls through
//! `Idem::postgres` (idem's own connections for claims and records) and through
//! `Idem::from_pool` on an application's sqlx pool, with and without sqlx's ping on
//! acquire, side by side in one run.
//!
//! ```text
//! cargo bench --bench pg_pools
//! ```
//!
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! `IDEM_BENCH_SECS` sets one measurement's length (default 2), `IDEM_BENCH_ROUNDS` the
//! rounds (default 3; the median is reported). Tables are new and dropped at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError};
use sqlx::postgres::PgPoolOptions;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const CALLERS: u64 = 16;
const REPLAY_KEYS: u64 = 2000;

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Calls per second from `CALLERS` tasks for `secs`, each call a fresh key (from
/// `next`) or one of the recorded keys.
async fn measure(idem: &Idem, fresh: bool, secs: f64, next: &Arc<AtomicU64>) -> Res<f64> {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..CALLERS)
        .map(|t| {
            let (idem, next) = (idem.clone(), next.clone());
            tokio::spawn(async move {
                let mut done = 0u64;
                let mut i = t;
                while Instant::now() < deadline {
                    let key = if fresh {
                        next.fetch_add(1, Ordering::Relaxed)
                    } else {
                        i = (i + 7919) % REPLAY_KEYS;
                        i
                    };
                    idem.operation("pools", &key)
                        .run(|| async { Ok::<_, IdemError>(1u32) })
                        .await?;
                    done += 1;
                }
                Ok::<_, IdemError>(done)
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / secs)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Res<()> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let secs = env_f64("IDEM_BENCH_SECS", 2.0);
    let rounds = env_f64("IDEM_BENCH_ROUNDS", 3.0) as usize;
    let pid = std::process::id();
    let tables: Vec<String> = (0..3)
        .map(|i| format!("idem_bench_pools_{pid}_{i}"))
        .collect();

    // The in-process replay cache is off: every replay reaches the database.
    let own = Idem::builder()
        .table(tables[0].clone())
        .replay_cache_bytes(0)
        .max_connections(CALLERS as u32)
        .postgres(&url)
        .await?;
    let pinging = PgPoolOptions::new()
        .max_connections(CALLERS as u32)
        .connect(&url)
        .await?;
    let quiet = PgPoolOptions::new()
        .max_connections(CALLERS as u32)
        .test_before_acquire(false)
        .connect(&url)
        .await?;
    let app = |table: &String, pool: &sqlx::PgPool| {
        Idem::builder()
            .table(table.clone())
            .replay_cache_bytes(0)
            .pool(pool.clone())
    };
    let subjects = [
        ("Idem::postgres (idem's own connections)", own),
        (
            "Idem::from_pool, sqlx defaults",
            app(&tables[1], &pinging).await?,
        ),
        (
            "Idem::from_pool, no ping on acquire",
            app(&tables[2], &quiet).await?,
        ),
    ];

    let next = Arc::new(AtomicU64::new(REPLAY_KEYS));
    for (_, idem) in &subjects {
        // The replay keys, recorded once per table; also warms every connection.
        for key in 0..REPLAY_KEYS {
            idem.operation("pools", &key)
                .run(|| async { Ok::<_, IdemError>(1u32) })
                .await?;
        }
    }
    let mut results = vec![(Vec::new(), Vec::new()); subjects.len()];
    for _ in 0..rounds {
        for (i, (_, idem)) in subjects.iter().enumerate() {
            results[i].0.push(measure(idem, true, secs, &next).await?);
            results[i].1.push(measure(idem, false, secs, &next).await?);
        }
    }
    let base = (median(results[1].0.clone()), median(results[1].1.clone()));
    println!(
        "| {CALLERS} callers | fresh ops/s | vs sqlx defaults | replay ops/s | vs sqlx defaults |"
    );
    println!("|---|---:|---:|---:|---:|");
    for ((label, _), (fresh, replay)) in subjects.iter().zip(results) {
        let (fresh, replay) = (median(fresh), median(replay));
        println!(
            "| {label} | {fresh:.0} | {:.2} | {replay:.0} | {:.2} |",
            fresh / base.0,
            replay / base.1
        );
    }
    println!(
        "\nMedians of {rounds} rounds of {secs}s, subjects alternating; `cargo bench --bench pg_pools`."
    );
    for table in &tables {
        sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
            .execute(&quiet)
            .await?;
        sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = $1")
            .bind(table)
            .execute(&quiet)
            .await?;
    }
    Ok(())
}
