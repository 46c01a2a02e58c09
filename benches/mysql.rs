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
//! as the store does: the replay read, then (for a fresh key) the claim, one `CALL` of
//! the stored procedure that runs its transaction, then the record. The rows are
//! medians of the rounds, idem and the baseline alternating within each round; the
//! in-process replay cache is off, so every replay reaches the server.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use idem_runtime::{Idem, IdemError, KeyPart};
use sqlx::mysql::{MySqlArguments, MySqlPool, MySqlRow};
use sqlx::{Column, MySql, Row};

mod support;

use support::config::Knobs;
use support::driver::{Contender, Driven, Stop, drive, median, rounds};
use support::{FINGERPRINT, LEASE_MS, NAME, POOL, RETAIN_MS, Res, check};

type Query<'q> = sqlx::query::Query<'q, MySql, MySqlArguments>;

/// Keys recorded before the replay rows, replayed round-robin.
const REPLAY_KEYS: u64 = 2000;

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

impl Driven for Subject {
    type Phase = Phase;
    type Held = ();

    fn seq(&self) -> &AtomicU64 {
        &self.seq
    }

    async fn hold(&self) -> Res<()> {
        Ok(())
    }

    async fn call(&self, phase: Phase, i: u64, _: &mut ()) -> Res<()> {
        let key = match phase {
            Phase::Fresh => format!("k{i}"),
            Phase::Replay { from } => format!("k{}", from + i % REPLAY_KEYS),
        };
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
                let mine = get::<i64>(&row, "mine")? != 0;
                if replaying {
                    check(!mine, "a replay claimed")?;
                    check(get::<i64>(&row, "state")? == 1, "not completed")?;
                    return check_outcome(&row);
                }
                check(mine, "the claim was not ours")?;
                values.epoch = get(&row, "epoch")?;
                let (sql, names) = &record[0];
                let done = values.bind(sql, names)?.execute(&self.pool).await?;
                check(done.rows_affected() == 1, "the record was fenced")
            }
        }
    }
}

impl Subject {
    /// The claim, as the store issues it: one statement, the call of its procedure,
    /// which answers with the row it decided.
    async fn claim(&self, claim: &Statements, values: &Values<'_>) -> Res<MySqlRow> {
        let [(sql, names)] = claim.as_slice() else {
            return Err("the claim is not one statement".into());
        };
        let rows = values.bind(sql, names)?.fetch_all(&self.pool).await?;
        Ok(rows.into_iter().next().ok_or("the claim returned no row")?)
    }
}

/// The column `name` of `row`, found by the name the server gave it (a `CALL`'s rows
/// carry their names only there: sqlx's names come from the prepared statement, which
/// has no columns of its own).
fn get<'r, T>(row: &'r MySqlRow, name: &str) -> Res<T>
where
    T: sqlx::Decode<'r, MySql> + sqlx::Type<MySql>,
{
    let at = row.columns().iter().position(|c| c.name() == name);
    Ok(row.try_get(at.ok_or_else(|| format!("no column `{name}`"))?)?)
}

fn check_outcome(row: &MySqlRow) -> Res<()> {
    let body: Vec<u8> = get(row, "outcome")?;
    check(
        serde_json::from_slice::<u32>(&body)? == 1,
        "another outcome",
    )
}

/// Records `REPLAY_KEYS` keys from the subject's next index on; the phase that replays
/// them.
async fn prepare_replays(subject: &Arc<Subject>) -> Res<Phase> {
    let from = subject.seq.load(Ordering::Relaxed);
    drive(subject, Phase::Fresh, POOL as usize, Stop::Ops(REPLAY_KEYS)).await?;
    Ok(Phase::Replay { from })
}

fn main() -> Res<()> {
    support::block_on(bench())
}

async fn bench() -> Res<()> {
    let knobs = Knobs::from_env("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
    let pool = || knobs.pool::<MySql>().connect(&knobs.url);
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
    // Labelled as the report's columns.
    let subjects = [
        ("idem", Side::Idem(idem)),
        ("same statements via sqlx", sqlx(Reads::Replays)?),
        ("sqlx, claim only", sqlx(Reads::Never)?),
        ("sqlx, read before every call", sqlx(Reads::Always)?),
    ];
    let subjects: Vec<(&'static str, Arc<Subject>)> = subjects
        .into_iter()
        .enumerate()
        .map(|(n, (label, side))| {
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
            (label, Arc::new(subject))
        })
        .collect();
    let result = measure_all(&knobs, &subjects).await;
    for table in [&idem_table, &sqlx_table] {
        for t in [
            format!("{table}_steps"),
            table.clone(),
            format!("{table}_epoch_seq"),
        ] {
            sqlx::query(&format!("DROP TABLE IF EXISTS `{t}`"))
                .execute(&sqlx_pool)
                .await?;
        }
        sqlx::query(&format!("DROP PROCEDURE IF EXISTS `{table}_claim`"))
            .execute(&sqlx_pool)
            .await?;
    }
    result
}

async fn measure_all(knobs: &Knobs, subjects: &[(&'static str, Arc<Subject>)]) -> Res<()> {
    println!(
        "| operation | idem ops/s | same statements via sqlx | idem / sqlx | \
         sqlx, claim only | idem / that | sqlx, read before every call | idem / that |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for concurrency in [1, 16] {
        for replay in [false, true] {
            let mut contenders: Vec<Contender<Subject>> = Vec::new();
            for (label, subject) in subjects {
                let phase = if replay {
                    prepare_replays(subject).await?
                } else {
                    Phase::Fresh
                };
                contenders.push((*label, subject.clone(), phase));
            }
            let got = rounds(knobs, &contenders, concurrency).await?;
            let ops: Vec<f64> = got.iter().map(|(_, r)| median(r)).collect();
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
