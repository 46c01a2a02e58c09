//! The MySQL / MariaDB benchmark: idem against the same statements issued directly
//! through sqlx, on identical pools, at 1 and 16 callers.
//!
//! ```text
//! cargo bench -p idem-tests --bench mysql
//! ```
//!
//! The server at `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). Every
//! table is new, named after this process, and dropped at the end. Knobs, all optional:
//! `IDEM_BENCH_SECS` (one measurement, default 2), `IDEM_BENCH_ROUNDS` (rounds, default 3),
//! `IDEM_BENCH_NO_PING=1` (pools without sqlx's ping on acquire).
//!
//! The baseline's statements are rendered by the store's own engine from
//! `idem-runtime/sql/mysql/`, so they are the store's SQL as built, and it issues them
//! as the store does: the replay read, then (for a fresh key) the claim's statements in
//! one transaction, then the record. The
//! rows are medians of the rounds, idem and the baseline alternating within each round;
//! the in-process replay cache is off, so every replay reaches the server.

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError, KeyPart};
use sqlx::mysql::{MySqlArguments, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::{MySql, Row};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;
type Query<'q> = sqlx::query::Query<'q, MySql, MySqlArguments>;

/// Connections per pool: the highest concurrency measured.
const POOL: u32 = 16;
/// Keys recorded before the replay rows, replayed round-robin.
const REPLAY_KEYS: u64 = 2000;
const NAME: &str = "bench";
const LEASE_MS: i64 = 60_000;
const RETAIN_MS: i64 = 86_400_000;
/// The fingerprint the baseline claims with (idem computes its own).
const FINGERPRINT: [u8; 32] = [7; 32];

/// A statement file, as the store renders it: each statement with the names its `?`s
/// bind.
type Statements = Vec<(String, Vec<String>)>;

/// One value for each parameter the claim and the record bind.
struct Values<'a> {
    key: &'a str,
    token: i64,
    epoch: i64,
    outcome: &'a [u8],
}

impl Values<'_> {
    fn bind<'q>(&'q self, sql: &'q str, names: &[String]) -> Res<Query<'q>> {
        let mut q = sqlx::query(sql);
        for name in names {
            q = match name.as_str() {
                "scope" => q.bind(""),
                "name" => q.bind(NAME),
                "key" => q.bind(self.key),
                "fp" => q.bind(&FINGERPRINT[..]),
                "token" => q.bind(self.token),
                "epoch" => q.bind(self.epoch),
                "lease_ms" => q.bind(LEASE_MS),
                "to_unknown" => q.bind(false),
                "outcome" => q.bind(self.outcome),
                "is_err" => q.bind(false),
                "version" => q.bind(1_i64),
                "retain_ms" => q.bind(RETAIN_MS),
                other => return Err(format!("the bench has no value for `:{other}`").into()),
            };
        }
        Ok(q)
    }
}

/// When the baseline issues the replay read before the claim.
#[derive(Clone, Copy, PartialEq)]
enum Reads {
    /// Never: every replay is decided by the claim's transaction.
    Never,
    /// In the replay rows only, as the store does once it has seen replays.
    Replays,
    /// Before every call, fresh ones included.
    Always,
}

enum Side {
    Idem(Idem),
    /// The store's statements issued through sqlx, reading first as `reads` says.
    Sqlx {
        reads: Reads,
        peek: Statements,
        claim: Statements,
        record: Statements,
    },
}

struct Subject {
    side: Side,
    pool: MySqlPool,
    seq: AtomicU64,
    tokens: AtomicI64,
}

#[derive(Clone, Copy)]
enum Phase {
    Fresh,
    /// Replays of the keys `from .. from + REPLAY_KEYS`, recorded beforehand.
    Replay {
        from: u64,
    },
}

impl Subject {
    fn key(&self, phase: Phase, i: u64) -> String {
        match phase {
            Phase::Fresh => format!("k{i}"),
            Phase::Replay { from } => format!("k{}", from + i % REPLAY_KEYS),
        }
    }

    async fn call(&self, phase: Phase, i: u64) -> Res<()> {
        let key = self.key(phase, i);
        match &self.side {
            Side::Idem(idem) => {
                let got = idem
                    .operation(NAME, &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(|| async { Ok::<_, IdemError>(1u32) })
                    .await?;
                check(got == 1, "idem returned another outcome")
            }
            Side::Sqlx {
                reads,
                peek,
                claim,
                record,
            } => {
                let key = key.encode_key();
                let outcome = serde_json::to_vec(&1u32)?;
                let mut values = Values {
                    key: &key,
                    token: self.tokens.fetch_add(1, Ordering::Relaxed),
                    epoch: 0,
                    outcome: &outcome,
                };
                let replaying = matches!(phase, Phase::Replay { .. });
                if *reads == Reads::Always || (*reads == Reads::Replays && replaying) {
                    let (sql, names) = &peek[0];
                    let peeked = values.bind(sql, names)?.fetch_optional(&self.pool).await?;
                    if replaying {
                        let row = peeked.ok_or("a replay found no completed record")?;
                        check(row.try_get::<i64, _>("same_fingerprint")? == 1, "mismatch")?;
                        return check_outcome(&row);
                    }
                    check(peeked.is_none(), "a fresh key was completed")?;
                }
                let row = self.claim(claim, &values).await?;
                let mine = row.try_get::<i64, _>("mine")? != 0;
                if replaying {
                    check(!mine, "a replay claimed")?;
                    check(row.try_get::<i64, _>("state")? == 1, "not completed")?;
                    return check_outcome(&row);
                }
                check(mine, "the claim was not ours")?;
                values.epoch = row.try_get("epoch")?;
                let (sql, names) = &record[0];
                let done = values.bind(sql, names)?.execute(&self.pool).await?;
                check(done.rows_affected() == 1, "the record was fenced")
            }
        }
    }

    /// The claim's statements in one transaction; the last one's row.
    async fn claim(&self, claim: &Statements, values: &Values<'_>) -> Res<MySqlRow> {
        let mut tx = self.pool.begin().await?;
        let (last, before) = claim.split_last().ok_or("an empty claim")?;
        for (sql, names) in before {
            values.bind(sql, names)?.execute(&mut *tx).await?;
        }
        let row = values.bind(&last.0, &last.1)?.fetch_one(&mut *tx).await?;
        tx.commit().await?;
        Ok(row)
    }
}

fn check_outcome(row: &MySqlRow) -> Res<()> {
    let body: Vec<u8> = row.try_get("outcome")?;
    check(
        serde_json::from_slice::<u32>(&body)? == 1,
        "another outcome",
    )
}

fn check(ok: bool, what: &'static str) -> Res<()> {
    if ok { Ok(()) } else { Err(what.into()) }
}

/// Runs `phase` on `concurrency` tasks for `secs`; returns operations per second.
async fn drive(subject: &Arc<Subject>, phase: Phase, concurrency: usize, d: Duration) -> Res<f64> {
    let deadline = Instant::now() + d;
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (subject, done) = (subject.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let i = subject.seq.fetch_add(1, Ordering::Relaxed);
                    subject.call(phase, i).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

/// Records `REPLAY_KEYS` keys from the subject's next index on; the phase that replays
/// them.
async fn prepare_replays(subject: &Arc<Subject>) -> Res<Phase> {
    let from = subject.seq.fetch_add(REPLAY_KEYS, Ordering::Relaxed);
    let tasks: Vec<_> = (0..POOL as u64)
        .map(|t| {
            let subject = subject.clone();
            tokio::spawn(async move {
                let mut i = t;
                while i < REPLAY_KEYS {
                    subject.call(Phase::Fresh, from + i).await?;
                    i += POOL as u64;
                }
                Ok::<_, Box<dyn Error + Send + Sync>>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(Phase::Replay { from })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> Res<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench())
}

async fn bench() -> Res<()> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let url = var("IDEM_MYSQL_URL").unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into());
    let secs: f64 = var("IDEM_BENCH_SECS").map_or(Ok(2.0), |v| v.parse())?;
    let rounds: usize = var("IDEM_BENCH_ROUNDS").map_or(Ok(3), |v| v.parse())?;
    let measure = Duration::from_secs_f64(secs);
    let ping = var("IDEM_BENCH_NO_PING").is_none_or(|v| v == "0");
    let pool = || {
        MySqlPoolOptions::new()
            .max_connections(POOL)
            .min_connections(POOL)
            .test_before_acquire(ping)
            .connect(&url)
    };
    let (idem_pool, sqlx_pool) = (pool().await?, pool().await?);
    let pid = std::process::id();
    let (idem_table, sqlx_table) = (
        format!("idem_bench_{pid}"),
        format!("idem_bench_{pid}_sqlx"),
    );
    let idem = Idem::builder()
        .table(idem_table.clone())
        .replay_cache_bytes(0)
        .pool(idem_pool.clone())
        .await?;
    // The baseline's table is made by the store too, then used only through sqlx.
    Idem::builder()
        .table(sqlx_table.clone())
        .pool(sqlx_pool.clone())
        .await?;
    let stmts = |name| idem_runtime::store::bench::mysql_statements(name, &sqlx_table);
    let sqlx = |reads| -> Res<Side> {
        Ok(Side::Sqlx {
            reads,
            peek: stmts("peek")?,
            claim: stmts("claim")?,
            record: stmts("record")?,
        })
    };
    let subjects = [
        Side::Idem(idem),
        sqlx(Reads::Replays)?,
        sqlx(Reads::Never)?,
        sqlx(Reads::Always)?,
    ];
    let subjects: Vec<Arc<Subject>> = subjects
        .into_iter()
        .enumerate()
        .map(|(n, side)| {
            let pool = match side {
                Side::Idem(_) => idem_pool.clone(),
                Side::Sqlx { .. } => sqlx_pool.clone(),
            };
            let subject = Subject {
                side,
                pool,
                // Each subject its own keys: two of them share the baseline's table.
                seq: AtomicU64::new(n as u64 * 1_000_000_000),
                tokens: AtomicI64::new(i64::from(pid) << 32 | (n as i64) << 28),
            };
            Arc::new(subject)
        })
        .collect();
    let result = measure_all(&subjects, measure, rounds).await;
    for table in [&idem_table, &sqlx_table] {
        for t in [table.clone(), format!("{table}_epoch_seq")] {
            sqlx::query(&format!("DROP TABLE IF EXISTS `{t}`"))
                .execute(&sqlx_pool)
                .await?;
        }
    }
    result
}

async fn measure_all(subjects: &[Arc<Subject>], d: Duration, rounds: usize) -> Res<()> {
    println!(
        "| operation | idem ops/s | same statements via sqlx | idem / sqlx | \
         sqlx, claim only | idem / that | sqlx, read before every call | idem / that |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for concurrency in [1, 16] {
        for replay in [false, true] {
            let mut phases = Vec::new();
            for subject in subjects {
                phases.push(if replay {
                    prepare_replays(subject).await?
                } else {
                    Phase::Fresh
                });
            }
            let warm = Duration::from_millis(300);
            for (subject, phase) in subjects.iter().zip(&phases) {
                drive(subject, *phase, concurrency, warm).await?;
            }
            let mut got = vec![Vec::new(); subjects.len()];
            for _ in 0..rounds {
                for ((subject, phase), got) in subjects.iter().zip(&phases).zip(&mut got) {
                    got.push(drive(subject, *phase, concurrency, d).await?);
                }
            }
            let ops: Vec<f64> = got.into_iter().map(median).collect();
            let what = if replay { "replay" } else { "fresh call" };
            let callers = if concurrency == 1 {
                "caller"
            } else {
                "callers"
            };
            let mut line = format!("| {what}, {concurrency} {callers} | {:.0} |", ops[0]);
            for other in &ops[1..] {
                line += &format!(" {other:.0} | {:.2} |", ops[0] / other);
            }
            println!("{line}");
        }
    }
    Ok(())
}
