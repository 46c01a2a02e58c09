//! How idem's connections and group commit affect throughput on PostgreSQL: the same
//! calls through `Idem::postgres` (idem's own connections for claims and records) and
//! through `Idem::from_pool` on an application's sqlx pool, with and without sqlx's ping
//! on acquire, with group commit on and off, and with fewer connections than callers
//! (where group commit gathers every claim), side by side in one run.
//!
//! ```text
//! cargo bench -p idem-tests --bench pg_pools
//! ```
//!
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! `IDEM_BENCH_SECS` sets one measurement's length (default 2), `IDEM_BENCH_ROUNDS` the
//! rounds (default 3; the median is reported), `IDEM_BENCH_CALLERS` the concurrent
//! callers (default 16; each subject holds at most 16 connections). Tables are new and dropped at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError};
use sqlx::postgres::PgPoolOptions;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Callers unless `IDEM_BENCH_CALLERS` says otherwise.
const CALLERS: u64 = 16;
const REPLAY_KEYS: u64 = 2000;

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Calls per second from `callers` tasks for `secs`, each call a fresh key (from
/// `next`) or one of the recorded keys.
async fn measure(
    idem: &Idem,
    callers: u64,
    fresh: bool,
    secs: f64,
    next: &Arc<AtomicU64>,
) -> Res<f64> {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..callers)
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
                        .retain(std::time::Duration::from_secs(86_400))
                        .fingerprint_none()
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
    let callers = env_f64("IDEM_BENCH_CALLERS", CALLERS as f64) as u64;
    // Every subject's connections are open at once: 16 each stays within the server's
    // default `max_connections` at any caller count.
    let connections = callers.min(CALLERS) as u32;
    let pid = std::process::id();
    let tables: Vec<String> = (0..7)
        .map(|i| format!("idem_bench_pools_{pid}_{i}"))
        .collect();

    // The in-process replay cache is off: every replay reaches the database.
    let own_n = |table: &String, group_commit: bool, connections: u32| {
        Idem::builder()
            .table(table.clone())
            .replay_cache_bytes(0)
            .group_commit(group_commit)
            .max_connections(connections)
            .postgres(&url)
    };
    let own = |table: &String, group_commit: bool| own_n(table, group_commit, connections);
    let pinging = PgPoolOptions::new()
        .max_connections(connections)
        .connect(&url)
        .await?;
    let quiet = PgPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .connect(&url)
        .await?;
    let app = |table: &String, pool: &sqlx::PgPool, group_commit: bool| {
        Idem::builder()
            .table(table.clone())
            .replay_cache_bytes(0)
            .group_commit(group_commit)
            .pool(pool.clone())
    };
    let subjects = [
        (
            "Idem::from_pool, sqlx defaults",
            app(&tables[0], &pinging, true).await?,
        ),
        (
            "Idem::from_pool, sqlx defaults, group commit off",
            app(&tables[1], &pinging, false).await?,
        ),
        (
            "Idem::from_pool, no ping on acquire",
            app(&tables[2], &quiet, true).await?,
        ),
        (
            "Idem::postgres (idem's own connections)",
            own(&tables[3], true).await?,
        ),
        (
            "Idem::postgres, group commit off",
            own(&tables[4], false).await?,
        ),
        // Fewer connections than callers, so claims queue and group commit gathers them.
        (
            "Idem::postgres, a quarter as many connections",
            own_n(&tables[5], true, (connections / 4).max(1)).await?,
        ),
        (
            "Idem::postgres, an eighth as many connections",
            own_n(&tables[6], true, (connections / 8).max(1)).await?,
        ),
    ];

    let next = Arc::new(AtomicU64::new(REPLAY_KEYS));
    for (_, idem) in &subjects {
        // The replay keys, recorded once per table; also warms every connection.
        for key in 0..REPLAY_KEYS {
            idem.operation("pools", &key)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async { Ok::<_, IdemError>(1u32) })
                .await?;
        }
    }
    let mut results = vec![(Vec::new(), Vec::new()); subjects.len()];
    for _ in 0..rounds {
        for (i, (_, idem)) in subjects.iter().enumerate() {
            results[i]
                .0
                .push(measure(idem, callers, true, secs, &next).await?);
            results[i]
                .1
                .push(measure(idem, callers, false, secs, &next).await?);
        }
    }
    let base = (median(results[0].0.clone()), median(results[0].1.clone()));
    println!(
        "| {callers} callers | fresh ops/s | vs sqlx defaults | replay ops/s | vs sqlx defaults |"
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
        "\nMedians of {rounds} rounds of {secs}s, subjects alternating; `cargo bench -p idem-tests --bench pg_pools`."
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
