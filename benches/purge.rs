//! Purge on PostgreSQL beside 10⁶ live records: a reaper tick with nothing expired, and
//! a backlog of 10⁵ expired records, with idem's statement and, side by side in the same
//! run, two alternatives: the same delete with each row locked first (`FOR UPDATE SKIP
//! LOCKED`, which idem uses only after a row held elsewhere stopped its statement), and
//! a delete whose expiry compares with `clock_timestamp()`, volatile, so the planner
//! cannot use the expiry index.
//!
//! `cargo bench -p idem-tests --bench purge` (PostgreSQL at `IDEM_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`; `IDEM_BENCH_LIVE` and
//! `IDEM_BENCH_EXPIRED` change the sizes).

use std::time::{Duration, Instant};

use idem_runtime::Idem;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "support/fill.rs"]
mod fill;
use fill::{drop_idem_table, env_or, fill};

/// The statements idem's purge is compared with.
#[derive(Clone, Copy)]
enum Old {
    /// idem's own, with each row locked before it is deleted (its fallback).
    Locked,
    /// Expiry against the volatile clock (`VOLATILE`).
    Volatile,
}

/// Rows chosen by primary key, expiry against the volatile clock, which keeps the expiry
/// index out of the plan.
const VOLATILE: &str = "DELETE FROM {table} WHERE (scope, name, key) IN (SELECT scope, name, \
     key FROM {table} WHERE state = 1 AND expires_at <= clock_timestamp() LIMIT 1000 FOR UPDATE \
     SKIP LOCKED) AND state = 1 AND expires_at <= clock_timestamp()";

/// Runs `old` on `table` in batches of 1,000 until one comes back short.
async fn old_purge(pool: &sqlx::PgPool, table: &str, old: Old) -> Res<u64> {
    let (sql, limit) = match old {
        // Rendered by the store's own engine; the batch size is its parameter.
        Old::Locked => (
            idem_runtime::store::bench::postgres_statement("purge_locked", table)?,
            Some(1000_i64),
        ),
        Old::Volatile => (VOLATILE.replace("{table}", table), None),
    };
    let mut total = 0;
    loop {
        let mut query = sqlx::query(&sql);
        if let Some(limit) = limit {
            query = query.bind(limit);
        }
        let n = query.execute(pool).await?.rows_affected();
        total += n;
        if n < 1000 {
            return Ok(total);
        }
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let live = env_or("IDEM_BENCH_LIVE", 1_000_000);
    let expired = env_or("IDEM_BENCH_EXPIRED", 100_000);
    let table = format!("idem_bench_purge_{}", std::process::id());
    let idem = Idem::builder().table(&table).postgres(&url).await?;
    let pool = sqlx::PgPool::connect(&url).await?;
    let result = run(&idem, &pool, &table, live, expired).await;
    drop_idem_table(&pool, &table).await?;
    result
}

async fn run(idem: &Idem, pool: &sqlx::PgPool, table: &str, live: i64, expired: i64) -> Res<()> {
    fill(pool, table, 1, live, "now() + interval '1 day'").await?;

    let (mut new_tick, mut old_tick) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = Instant::now();
        assert_eq!(idem.purge_expired().await?, 0);
        new_tick.push(t.elapsed());
        let t = Instant::now();
        assert_eq!(old_purge(pool, table, Old::Volatile).await?, 0);
        old_tick.push(t.elapsed());
    }
    let (new_tick, old_tick) = (median(new_tick), median(old_tick));

    // The backlog, three times each way, alternating; medians.
    let mut backlog: [Vec<Duration>; 3] = Default::default();
    for _ in 0..3 {
        for (i, times) in backlog.iter_mut().enumerate() {
            fill(pool, table, live + 1, expired, "now() - interval '1 hour'").await?;
            // Records past their retention are old: vacuumed, their pages all-visible.
            sqlx::query(&format!("VACUUM {table}"))
                .execute(pool)
                .await?;
            let t = Instant::now();
            let purged = match i {
                0 => idem.purge_expired().await?,
                1 => old_purge(pool, table, Old::Locked).await?,
                _ => old_purge(pool, table, Old::Volatile).await?,
            };
            times.push(t.elapsed());
            assert_eq!(purged, expired as u64);
        }
    }
    let [new_backlog, locked_backlog, old_backlog] = backlog.map(median);

    println!("purge beside {live} live records (PostgreSQL, batches of 1000)");
    println!("| case | idem | rows locked first | ratio | clock_timestamp() statement | ratio |");
    println!("|---|---|---|---|---|---|");
    let ratio = |a: Duration, b: Duration| b.as_secs_f64() / a.as_secs_f64();
    println!(
        "| tick, nothing expired (median of 7) | {} | | | {} | {:.0}× |",
        ms(new_tick),
        ms(old_tick),
        ratio(new_tick, old_tick)
    );
    println!(
        "| {expired} expired records (median of 3) | {} | {} | {:.1}× | {} | {:.1}× |",
        ms(new_backlog),
        ms(locked_backlog),
        ratio(new_backlog, locked_backlog),
        ms(old_backlog),
        ratio(new_backlog, old_backlog)
    );
    Ok(())
}
