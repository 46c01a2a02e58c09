//! The PostgreSQL benchmark: idem against the same SQL issued directly through sqlx, and
//! against the pgbench floor (the fewest statements that give the same guarantee).
//!
//! ```text
//! cargo bench --bench pg
//! ```
//!
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! `pgbench` on the `PATH` or under `/usr/lib/postgresql/*/bin`. Every table is new,
//! named after this process, and dropped at the end. Knobs, all optional:
//! `IDEM_BENCH_SECS` (one measurement, default 2), `IDEM_BENCH_ROUNDS` (A/B rounds, default
//! 3), `IDEM_BENCH_PGBENCH_SECS` (default 5), `IDEM_BENCH_NO_PING=1` (pools without sqlx's
//! ping on every acquire), `IDEM_BENCH_NO_RENEW=1` (idem without the lease renewal task).
//!
//! Statements and round trips per operation are counted on the wire: a short counted run
//! goes through a small TCP proxy that reads the client's protocol messages (each `Query`
//! or `Execute` is a statement; each `Sync` or `Query` a round trip). The server's own
//! `pg_stat_database.xact_commit` and `pg_stat_user_tables` cross-check them.

use std::collections::BTreeSet;
use std::error::Error;
use std::process::Command;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError, KeyPart, OperationId, TxStep};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgSslMode};
use sqlx::{Executor, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Connections per pool: the highest concurrency measured.
const POOL: u32 = 16;
/// Keys recorded before the replay phases (idem, sqlx and pgbench alike).
const REPLAY_KEYS: u64 = 5000;
/// Operations in each counted run, and before it to warm the statement caches.
const COUNTED: u64 = 400;
const NAME: &str = "bench";
/// idem's defaults, as the sqlx baseline binds them.
const LEASE_MS: i64 = 60_000;
const RETAIN_MS: i64 = 86_400_000;

// The statements idem issues, copied from idem-runtime/src/store/postgres.rs. The counted
// run checks on the wire that idem sends exactly these; the report says if it does not.

const EXPIRED: &str = "(cur.state = 1 AND cur.expires_at <= EXCLUDED.claimed_at)";

const LAPSED: &str = "(cur.state = 0 AND cur.lease_until <= EXCLUDED.claimed_at \
                      AND cur.fingerprint = EXCLUDED.fingerprint)";

const CLAIM: &str = "WITH ins AS (
    INSERT INTO {table} AS cur (scope, name, key, state, epoch, fingerprint, taken_over,
        lease_until, created_at, claimed_at, expires_at, outcome, outcome_is_err,
        outcome_version, waiters)
    SELECT $1, $2, $3, 0, 1, $4, false, n.now + $5::bigint * interval '1 millisecond',
        n.now, n.now, NULL, NULL, false, 0, false
    FROM (SELECT clock_timestamp() AS now) AS n
    ON CONFLICT (scope, name, key) DO UPDATE SET
        state = CASE WHEN {expired} OR NOT $6 THEN 0 ELSE 2 END,
        epoch = CASE WHEN {expired} OR NOT $6 THEN cur.epoch + 1 ELSE cur.epoch END,
        fingerprint = EXCLUDED.fingerprint,
        taken_over = CASE WHEN {expired} THEN false WHEN $6 THEN cur.taken_over ELSE true END,
        lease_until = CASE WHEN {expired} OR NOT $6 THEN EXCLUDED.lease_until
                           ELSE cur.lease_until END,
        created_at = CASE WHEN {expired} THEN EXCLUDED.created_at ELSE cur.created_at END,
        claimed_at = CASE WHEN {expired} OR NOT $6 THEN EXCLUDED.claimed_at
                          ELSE cur.claimed_at END,
        expires_at = NULL,
        outcome = NULL,
        outcome_is_err = false,
        outcome_version = 0,
        waiters = CASE WHEN {expired} THEN false ELSE cur.waiters END
    WHERE {expired} OR {lapsed}
    RETURNING true AS mine, false AS stale, cur.state, cur.epoch,
        true AS same_fingerprint, cur.taken_over, 0::bigint AS retry_after_ms, cur.outcome,
        cur.outcome_is_err, cur.outcome_version
)
SELECT mine, stale, state, epoch, same_fingerprint, taken_over, retry_after_ms, outcome,
    outcome_is_err, outcome_version
FROM ins
UNION ALL
SELECT false, COALESCE((state = 0 AND lease_until <= clock_timestamp() AND fingerprint = $4)
        OR (state = 1 AND expires_at <= clock_timestamp()), false),
    state, epoch, fingerprint = $4, taken_over,
    greatest(0, (EXTRACT(EPOCH FROM lease_until - clock_timestamp()) * 1000)::bigint),
    outcome, outcome_is_err, outcome_version
FROM {table}
WHERE scope = $1 AND name = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM ins)";

const PEEK: &str = "SELECT fingerprint = $4 AS same_fingerprint,
        CASE WHEN fingerprint = $4 THEN outcome END AS outcome, outcome_is_err, outcome_version
    FROM {table}
    WHERE scope = $1 AND name = $2 AND key = $3 AND state = 1
      AND expires_at > clock_timestamp()";

const RECORD: &str = "WITH upd AS (
    UPDATE {table}
    SET state = 1, outcome = $6, outcome_is_err = $7, outcome_version = $8,
        expires_at = clock_timestamp() + $9::bigint * interval '1 millisecond'
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4 AND state = 0
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', $5) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke";

const FRESH_SQL: &str = include_str!("pgbench/fresh.sql");
const REPLAY_SQL: &str = include_str!("pgbench/replay.sql");
const TX_SQL: &str = include_str!("pgbench/tx.sql");

/// The floor's table: idem's key and an outcome, nothing else.
const FLOOR_DDL: &str = "CREATE TABLE {table} (scope TEXT NOT NULL, name TEXT NOT NULL,
    key TEXT NOT NULL, outcome BYTEA, PRIMARY KEY (scope, name, key))";
const ORDERS_DDL: &str = "CREATE TABLE {table} (id TEXT PRIMARY KEY, qty BIGINT NOT NULL)";

/// Any fixed fingerprint: the baseline binds 32 bytes, as idem does.
const FINGERPRINT: [u8; 32] = [7; 32];

struct Config {
    url: String,
    measure: Duration,
    rounds: usize,
    pgbench_secs: u64,
    ping: bool,
    renew: bool,
    prefix: String,
}

impl Config {
    fn from_env() -> Config {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let set = |name: &str| var(name).is_some_and(|v| v != "0");
        Config {
            url: var("IDEM_POSTGRES_URL")
                .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".into()),
            measure: Duration::from_secs_f64(
                var("IDEM_BENCH_SECS")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(2.0),
            ),
            rounds: var("IDEM_BENCH_ROUNDS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(3)
                .max(1),
            pgbench_secs: var("IDEM_BENCH_PGBENCH_SECS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(5),
            ping: !set("IDEM_BENCH_NO_PING"),
            renew: !set("IDEM_BENCH_NO_RENEW"),
            prefix: format!("idem_bench_{}", std::process::id()),
        }
    }

    /// The same pool for idem and for the baseline: idem's defaults, but big enough.
    fn pool(&self) -> PgPoolOptions {
        PgPoolOptions::new()
            .max_connections(POOL)
            .min_connections(POOL)
            .test_before_acquire(self.ping)
    }

    fn table(&self, phase: &str) -> String {
        format!("{}_{phase}", self.prefix)
    }
}

fn quoted(table: &str) -> String {
    format!("\"{table}\"")
}

/// The baseline's statements, rendered for its table as idem renders them for its own.
struct Sql {
    claim: String,
    peek: String,
    record: String,
}

impl Sql {
    fn new(table: &str) -> Sql {
        let r = |sql: &str| sql.replace("{table}", &quoted(table));
        Sql {
            claim: r(&CLAIM
                .replace("{lapsed}", LAPSED)
                .replace("{expired}", EXPIRED)),
            peek: r(PEEK),
            record: r(RECORD),
        }
    }
}

enum Side {
    Idem(Idem),
    Sqlx(Sql),
}

/// One side of a comparison: idem on its table, or the baseline's SQL on its own.
struct Subject {
    side: Side,
    pool: PgPool,
    table: String,
    /// `INSERT` of the business row, for the transactional phase.
    order: String,
    /// The next key index; keys are never reused within a table.
    seq: AtomicU64,
    /// How many times the body ran (idem) or a claim was won (baseline).
    runs: AtomicU64,
}

#[derive(Clone, Copy)]
enum Phase {
    Fresh,
    /// Replays of the keys `from..from + keys`, recorded beforehand.
    Replay {
        from: u64,
        keys: u64,
    },
    Tx,
}

fn key(i: u64) -> String {
    format!("k{i}")
}

/// The body's error in transactional mode: idem's, or the business write's.
#[derive(Debug)]
enum TxError {
    Idem(IdemError),
    Sql(sqlx::Error),
}

impl From<IdemError> for TxError {
    fn from(e: IdemError) -> Self {
        TxError::Idem(e)
    }
}

impl std::fmt::Display for TxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TxError::Idem(e) => e.fmt(f),
            TxError::Sql(e) => e.fmt(f),
        }
    }
}

impl Error for TxError {}

impl Subject {
    async fn idem(cfg: &Config, pool: &PgPool, table: String, orders: &str) -> Res<Subject> {
        let idem = Idem::builder()
            .table(table.clone())
            .renew_leases(cfg.renew)
            .pool(pool.clone())
            .await?;
        Ok(Subject::new(Side::Idem(idem), pool, table, orders))
    }

    async fn sqlx(admin: &PgPool, pool: &PgPool, table: String, orders: &str) -> Res<Subject> {
        let ddl = idem_runtime::schema::POSTGRES_SCHEMA_SQL.replace("idem_operations", &table);
        sqlx::raw_sql(&ddl).execute(admin).await?;
        Ok(Subject::new(
            Side::Sqlx(Sql::new(&table)),
            pool,
            table,
            orders,
        ))
    }

    fn new(side: Side, pool: &PgPool, table: String, orders: &str) -> Subject {
        Subject {
            side,
            pool: pool.clone(),
            table,
            order: format!("INSERT INTO {} (id, qty) VALUES ($1, $2)", quoted(orders)),
            seq: AtomicU64::new(0),
            runs: AtomicU64::new(0),
        }
    }

    async fn call(&self, phase: Phase, i: u64) -> Res<()> {
        let key = match phase {
            Phase::Replay { from, keys } => key(from + i % keys),
            Phase::Fresh | Phase::Tx => key(i),
        };
        match (&self.side, phase) {
            (Side::Idem(idem), Phase::Fresh | Phase::Replay { .. }) => {
                let got = idem
                    .operation(NAME, &key)
                    .run(|| async {
                        self.runs.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, IdemError>(1u32)
                    })
                    .await?;
                check(got == 1, "idem returned another outcome")
            }
            (Side::Idem(idem), Phase::Tx) => {
                let mut tx = self.pool.begin().await?;
                let step: TxStep<u32, TxError, _> =
                    idem.operation(NAME, &key).begin_tx(&mut tx).await?;
                let TxStep::Run(guard) = step else {
                    return Err("a fresh key was replayed".into());
                };
                let out: Result<u32, TxError> = async {
                    self.runs.fetch_add(1, Ordering::Relaxed);
                    sqlx::query(&self.order)
                        .bind(&key)
                        .bind(1_i64)
                        .execute(&mut *tx)
                        .await
                        .map_err(TxError::Sql)?;
                    Ok(1u32)
                }
                .await;
                guard.finish(&mut tx, out).await?;
                tx.commit().await?;
                Ok(())
            }
            (Side::Sqlx(sql), Phase::Fresh) => self.fresh(sql, &key).await,
            (Side::Sqlx(sql), Phase::Replay { .. }) => self.peek(sql, &key).await,
            (Side::Sqlx(_), Phase::Tx) => {
                let mut tx = self.pool.begin().await?;
                sqlx::query(&self.order)
                    .bind(&key)
                    .bind(1_i64)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }
        }
    }

    fn id(key: &str) -> OperationId {
        OperationId {
            scope: String::new(),
            name: NAME.into(),
            key: key.encode_key(),
        }
    }

    /// What idem does for a fresh key, minus idem: the claim, then the record.
    async fn fresh(&self, sql: &Sql, key: &str) -> Res<()> {
        let id = Subject::id(key);
        let claim = sqlx::query(&sql.claim)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..])
            .bind(LEASE_MS)
            .bind(false)
            .fetch_optional(&self.pool)
            .await?
            .ok_or("the claim returned no row")?;
        check(claim.try_get::<bool, _>("mine")?, "the claim was not ours")?;
        let epoch: i64 = claim.try_get("epoch")?;
        self.runs.fetch_add(1, Ordering::Relaxed);
        let recorded = sqlx::query(&sql.record)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(serde_json::to_string(&id)?)
            .bind(serde_json::to_vec(&1u32)?)
            .bind(false)
            .bind(1_i32)
            .bind(RETAIN_MS)
            .fetch_one(&self.pool)
            .await?;
        check(
            recorded.try_get::<i64, _>("held")? == 1,
            "the record was fenced",
        )
    }

    /// What idem does for a replay, minus idem: the read-only peek.
    async fn peek(&self, sql: &Sql, key: &str) -> Res<()> {
        let id = Subject::id(key);
        let row = sqlx::query(&sql.peek)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..])
            .fetch_optional(&self.pool)
            .await?
            .ok_or("the peek found no completed record")?;
        check(row.try_get::<bool, _>("same_fingerprint")?, "mismatch")?;
        let outcome: Vec<u8> = row.try_get("outcome")?;
        check(
            serde_json::from_slice::<u32>(&outcome)? == 1,
            "another outcome",
        )
    }
}

fn check(ok: bool, what: &'static str) -> Res<()> {
    if ok { Ok(()) } else { Err(what.into()) }
}

enum Stop {
    After(Duration),
    Ops(u64),
}

/// Runs `phase` on `concurrency` tasks until `stop`; returns operations per second.
async fn drive(subject: &Arc<Subject>, phase: Phase, concurrency: usize, stop: Stop) -> Res<f64> {
    let (deadline, limit) = match stop {
        Stop::After(d) => (Some(Instant::now() + d), None),
        Stop::Ops(n) => (None, Some(subject.seq.load(Ordering::Relaxed) + n)),
    };
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (subject, done) = (subject.clone(), done.clone());
            tokio::spawn(async move {
                while deadline.is_none_or(|d| Instant::now() < d) {
                    let i = subject.seq.fetch_add(1, Ordering::Relaxed);
                    if limit.is_some_and(|l| i >= l) {
                        break;
                    }
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
    if let Some(limit) = limit {
        // The indices fetched past the limit ran nothing: the next run starts there.
        subject.seq.store(limit, Ordering::Relaxed);
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// idem and the baseline, alternately (A/B/A/B), after a short warm-up of each.
async fn ab(
    cfg: &Config,
    idem: &Arc<Subject>,
    base: &Arc<Subject>,
    phase: (Phase, Phase),
    concurrency: usize,
) -> Res<(Vec<f64>, Vec<f64>)> {
    let warm = Duration::from_millis(300);
    drive(idem, phase.0, concurrency, Stop::After(warm)).await?;
    drive(base, phase.1, concurrency, Stop::After(warm)).await?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..cfg.rounds {
        a.push(drive(idem, phase.0, concurrency, Stop::After(cfg.measure)).await?);
        b.push(drive(base, phase.1, concurrency, Stop::After(cfg.measure)).await?);
    }
    Ok((a, b))
}

/// What the client sent through the counting proxy.
#[derive(Default)]
struct Wire {
    queries: AtomicU64,
    executes: AtomicU64,
    syncs: AtomicU64,
    parses: AtomicU64,
    sql: Mutex<BTreeSet<String>>,
}

#[derive(Clone, Copy, Debug)]
struct Tally {
    queries: u64,
    executes: u64,
    syncs: u64,
    parses: u64,
}

impl Tally {
    fn since(self, before: Tally) -> Tally {
        Tally {
            queries: self.queries - before.queries,
            executes: self.executes - before.executes,
            syncs: self.syncs - before.syncs,
            parses: self.parses - before.parses,
        }
    }

    fn statements(self) -> u64 {
        self.queries + self.executes
    }

    /// Each `Sync` and each simple `Query` waits for the server; a `Parse` (a statement
    /// prepared on this connection for the first time) costs one of them, which a warm
    /// cache does not pay.
    fn round_trips(self) -> u64 {
        (self.syncs + self.queries).saturating_sub(self.parses)
    }
}

impl Wire {
    fn tally(&self) -> Tally {
        let n = |c: &AtomicU64| c.load(Ordering::SeqCst);
        Tally {
            queries: n(&self.queries),
            executes: n(&self.executes),
            syncs: n(&self.syncs),
            parses: n(&self.parses),
        }
    }

    fn take_sql(&self) -> BTreeSet<String> {
        std::mem::take(&mut *self.sql.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn message(&self, tag: u8, body: &[u8]) {
        let counter = match tag {
            b'Q' => &self.queries,
            b'E' => &self.executes,
            b'S' => &self.syncs,
            b'P' => &self.parses,
            _ => return,
        };
        counter.fetch_add(1, Ordering::SeqCst);
        // Parse: the statement's name, then its text, each NUL-terminated.
        let text = match tag {
            b'P' => body.splitn(3, |&b| b == 0).nth(1),
            b'Q' => body.split(|&b| b == 0).next(),
            _ => None,
        };
        if let Some(text) = text {
            let text = String::from_utf8_lossy(text).into_owned();
            self.sql
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(text);
        }
    }
}

/// Splits the client's byte stream into protocol messages.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
    started: bool,
    broken: bool,
}

impl Frames {
    fn feed(&mut self, bytes: &[u8], wire: &Wire) {
        if self.broken {
            return;
        }
        self.buf.extend_from_slice(bytes);
        let mut at = 0;
        loop {
            let rest = &self.buf[at..];
            // Startup-phase messages have no type byte.
            let head = if self.started { 5 } else { 8 };
            if rest.len() < head {
                break;
            }
            let len_at = usize::from(self.started);
            let len = u32::from_be_bytes([
                rest[len_at],
                rest[len_at + 1],
                rest[len_at + 2],
                rest[len_at + 3],
            ]) as usize;
            if len < head - len_at {
                self.broken = true;
                return;
            }
            let total = len + len_at;
            if rest.len() < total {
                break;
            }
            if self.started {
                wire.message(rest[0], &rest[5..total]);
            } else {
                let code = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]);
                // SSLRequest and GSSENCRequest are followed by another untyped message.
                self.started = !matches!(code, 80_877_103 | 80_877_104);
            }
            at += total;
        }
        self.buf.drain(..at);
    }
}

/// A TCP proxy to the server that counts what clients send; returns its port.
async fn spawn_proxy(host: String, port: u16, wire: Arc<Wire>) -> Res<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (host, wire) = (host.clone(), wire.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect((host.as_str(), port)).await else {
                    return;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let down = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
                let mut frames = Frames::default();
                let mut buf = vec![0; 16 * 1024];
                loop {
                    let n = match from_client.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    // Counted before it is forwarded, so a reply implies its count.
                    frames.feed(&buf[..n], &wire);
                    if to_server.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = to_server.shutdown().await;
                let _ = down.await;
            });
        }
    });
    Ok(local)
}

/// Statements, round trips, server transactions and table writes per operation.
struct Count {
    statements: f64,
    round_trips: f64,
    parses: u64,
    xacts: f64,
    writes: i64,
    runs: u64,
    sql: BTreeSet<String>,
}

impl Count {
    fn per_op(&self) -> String {
        format!("{:.2}", self.statements)
    }
}

struct Counter {
    admin: PgPool,
    pool: PgPool,
    wire: Arc<Wire>,
}

impl Counter {
    /// Makes every pooled connection flush its statistics now (PostgreSQL 15+), so the
    /// server's counters are current when read; returns how many statements that took.
    async fn flush_stats(&self) -> Res<i64> {
        let mut held = Vec::new();
        for _ in 0..self.pool.size() {
            held.push(self.pool.acquire().await?);
        }
        for conn in &mut held {
            conn.execute("SELECT pg_stat_force_next_flush()").await?;
        }
        Ok(i64::try_from(held.len())?)
    }

    /// Runs `phase` for [`COUNTED`] operations after as many to warm up.
    async fn count(&self, subject: &Arc<Subject>, phase: Phase, concurrency: usize) -> Res<Count> {
        self.wire.take_sql();
        drive(subject, phase, concurrency, Stop::Ops(COUNTED)).await?;
        self.flush_stats().await?;
        let writes = table_writes(&self.admin, &subject.table).await?;
        let xacts = xact_commits(&self.admin).await?;
        let runs = subject.runs.load(Ordering::Relaxed);
        let before = self.wire.tally();
        drive(subject, phase, concurrency, Stop::Ops(COUNTED)).await?;
        let tally = self.wire.tally().since(before);
        let flushes = self.flush_stats().await?;
        let xacts = xact_commits(&self.admin).await? - xacts - flushes;
        let per = |n: u64| n as f64 / COUNTED as f64;
        Ok(Count {
            statements: per(tally.statements()),
            round_trips: per(tally.round_trips()),
            parses: tally.parses,
            xacts: xacts as f64 / COUNTED as f64,
            writes: table_writes(&self.admin, &subject.table).await? - writes,
            runs: subject.runs.load(Ordering::Relaxed) - runs,
            sql: self.wire.take_sql(),
        })
    }
}

async fn xact_commits(admin: &PgPool) -> Res<i64> {
    Ok(sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(admin)
    .await?)
}

async fn table_writes(admin: &PgPool, table: &str) -> Res<i64> {
    let n: Option<i64> = sqlx::query_scalar(
        "SELECT n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables
         WHERE relid = to_regclass($1)",
    )
    .bind(quoted(table))
    .fetch_optional(admin)
    .await?;
    Ok(n.unwrap_or(0))
}

fn find_pgbench() -> Option<String> {
    let on_path = Command::new("pgbench").arg("--version").output();
    if on_path.is_ok_and(|o| o.status.success()) {
        return Some("pgbench".into());
    }
    let mut found: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|d| d.path().join("bin/pgbench"))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().map(|p| p.display().to_string())
}

/// One pgbench run of `script` with `{table}`-style placeholders filled in.
struct Floor<'a> {
    bin: &'a str,
    name: &'a str,
    script: String,
}

impl Floor<'_> {
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Res<String> {
        let path = std::env::temp_dir().join(format!(
            "idem-bench-{}-{}.sql",
            std::process::id(),
            self.name
        ));
        std::fs::write(&path, &self.script)?;
        let out = Command::new(self.bin)
            .args(["-n", "-M", "prepared", "-f"])
            .arg(&path)
            .args(args)
            .envs(env.iter().copied())
            .output();
        let _ = std::fs::remove_file(&path);
        let out = out?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() || !stdout.contains("number of failed transactions: 0") {
            return Err(format!(
                "pgbench {} failed: {}{}",
                self.name,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(stdout)
    }

    /// Transactions per second at `clients`, for `secs`.
    fn tps(&self, url: &str, clients: usize, secs: u64) -> Res<f64> {
        let (c, t) = (clients.to_string(), secs.to_string());
        let out = self.run(&["-c", &c, "-j", "2", "-T", &t, url], &[])?;
        let line = out
            .lines()
            .find(|l| l.starts_with("tps = ") && l.contains("without initial connection time"))
            .ok_or("no tps line in pgbench's output")?;
        Ok(line["tps = ".len()..]
            .split_whitespace()
            .next()
            .ok_or("empty tps line")?
            .parse()?)
    }

    /// Statements and round trips per transaction, through the counting proxy.
    fn count(&self, connect: &PgConnectOptions, port: u16, wire: &Wire) -> Res<(f64, f64)> {
        const TRANSACTIONS: u64 = 200;
        let before = wire.tally();
        let port = port.to_string();
        let t = TRANSACTIONS.to_string();
        let mut args = vec!["-c", "1", "-t", &t, "-h", "127.0.0.1", "-p", &port];
        args.extend(["-U", connect.get_username()]);
        args.extend(connect.get_database());
        self.run(&args, &[("PGSSLMODE", "disable")])?;
        let tally = wire.tally().since(before);
        let per = |n: u64| n as f64 / TRANSACTIONS as f64;
        Ok((per(tally.statements()), per(tally.round_trips())))
    }
}

/// One row of the report.
#[derive(Default)]
struct Line {
    label: &'static str,
    idem: Vec<f64>,
    base: Vec<f64>,
    floor: Option<f64>,
    count: Option<(Count, Count)>,
    floor_count: Option<(f64, f64)>,
}

fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 => format!("{:.2}", a / b),
        _ => "—".into(),
    }
}

fn print_report(cfg: &Config, lines: &[Line], server: &str) {
    let goal = |r: f64, g: f64| if r >= g { "" } else { " ✗" };
    println!();
    println!(
        "| phase | idem ops/s | sqlx baseline ops/s | idem/sqlx | pgbench floor tps | idem/pgbench \
         | statements/op idem (sqlx, floor) | round trips/op idem (sqlx, floor) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---|");
    for line in lines {
        let (idem, base) = (median(&line.idem), median(&line.base));
        let floor = line.floor.map_or_else(|| "—".into(), |f| format!("{f:.0}"));
        let (stmts, trips) = match (&line.count, line.floor_count) {
            (Some((i, b)), floor) => {
                let f = |x: Option<f64>| x.map_or_else(|| "—".into(), |x| format!("{x:.2}"));
                let added = if line.label.starts_with("tx") {
                    format!("; idem adds {:.2}", i.statements - b.statements)
                } else {
                    String::new()
                };
                (
                    format!(
                        "{} ({}, {}){added}",
                        i.per_op(),
                        b.per_op(),
                        f(floor.map(|f| f.0))
                    ),
                    format!(
                        "{:.2} ({:.2}, {})",
                        i.round_trips,
                        b.round_trips,
                        f(floor.map(|f| f.1))
                    ),
                )
            }
            (None, _) => ("—".into(), "—".into()),
        };
        let base_goal = goal(idem / base, 0.9);
        let floor_goal = line.floor.map_or("", |f| goal(idem / f, 0.8));
        println!(
            "| {} | {idem:.0} | {base:.0} | {}{base_goal} | {floor} | {}{floor_goal} | {stmts} | {trips} |",
            line.label,
            ratio(idem, Some(base)),
            ratio(idem, line.floor),
        );
    }
    println!();
    println!(
        "Medians of {} alternating rounds of {:.1}s (idem, sqlx, idem, sqlx, ...); pgbench -T {} \
         -j 2 -n -M prepared. ✗: below the goal (idem/sqlx >= 0.9, idem/pgbench >= 0.8).",
        cfg.rounds,
        cfg.measure.as_secs_f64(),
        cfg.pgbench_secs
    );
    println!("{server}");
    println!(
        "Pools: {POOL} connections, test_before_acquire({}); idem lease renewal {}.",
        cfg.ping,
        if cfg.renew { "on" } else { "off" }
    );
    println!();
    println!("Rounds (ops/s):");
    for line in lines {
        let show = |xs: &[f64]| {
            xs.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "  {:<13} idem [{}]  sqlx [{}]",
            line.label,
            show(&line.idem),
            show(&line.base)
        );
    }
    println!();
    println!("Counted runs ({COUNTED} operations each, after {COUNTED} to warm up):");
    for line in lines {
        if let Some((i, b)) = &line.count {
            println!(
                "  {:<13} server commits/op idem {:.2}, sqlx {:.2}; table writes idem {}, sqlx {}; \
                 bodies run idem {}, sqlx {}; statements prepared while counted {}, {}",
                line.label,
                i.xacts,
                b.xacts,
                i.writes,
                b.writes,
                i.runs,
                b.runs,
                i.parses,
                b.parses
            );
        }
    }
}

/// The tables a counted row used, renamed to placeholders so idem's SQL and the
/// baseline's compare.
struct Renames<'a> {
    idem: [(&'a str, &'a str); 2],
    base: [(&'a str, &'a str); 2],
}

/// Checks that idem sent the baseline's statements, and lists what else it sent.
fn compare_sql(lines: &[Line], renames: &[Renames<'_>]) {
    let normalize = |sql: &BTreeSet<String>, renames: &[(&str, &str)]| -> BTreeSet<String> {
        sql.iter()
            .map(|s| {
                renames
                    .iter()
                    .fold(s.clone(), |s, (from, to)| s.replace(&quoted(from), to))
            })
            .collect()
    };
    let head = |s: &&String| s.lines().next().unwrap_or("").trim().to_owned();
    println!();
    println!("SQL on the wire:");
    for (line, renames) in lines.iter().zip(renames) {
        let Some((i, b)) = &line.count else { continue };
        let idem = normalize(&i.sql, &renames.idem);
        let base = normalize(&b.sql, &renames.base);
        let missing: Vec<_> = base.difference(&idem).map(|s| head(&s)).collect();
        let extra: Vec<_> = idem.difference(&base).map(|s| head(&s)).collect();
        if missing.is_empty() {
            println!(
                "  {:<13} idem sent every statement of the baseline",
                line.label
            );
        } else {
            println!(
                "  {:<13} WARNING: idem did not send the baseline's [{}]; re-copy them from \
                 postgres.rs",
                line.label,
                missing.join(" | ")
            );
        }
        if !extra.is_empty() {
            println!("  {:<13} idem also sent [{}]", "", extra.join(" | "));
        }
    }
}

struct Tables {
    admin: PgPool,
    idem: Vec<String>,
    plain: Vec<String>,
}

impl Tables {
    async fn create(&mut self, ddl: &str, table: String) -> Res<String> {
        self.plain.push(table.clone());
        let sql = format!("DROP TABLE IF EXISTS {t}; {}", ddl, t = quoted(&table));
        sqlx::raw_sql(&sql.replace("{table}", &quoted(&table)))
            .execute(&self.admin)
            .await?;
        Ok(table)
    }

    async fn drop_all(&self) {
        for table in self.idem.iter().chain(&self.plain) {
            let drop = format!("DROP TABLE IF EXISTS {}", quoted(table));
            if let Err(e) = self.admin.execute(drop.as_str()).await {
                eprintln!("could not drop {table}: {e}");
            }
        }
        let forget = "DELETE FROM idem_schema_migrations WHERE table_name = ANY($1)";
        let bookkeeping: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('idem_schema_migrations')::text")
                .fetch_one(&self.admin)
                .await
                .unwrap_or(None);
        if bookkeeping.is_some() {
            let forgot = sqlx::query(forget)
                .bind(&self.idem)
                .execute(&self.admin)
                .await;
            if let Err(e) = forgot {
                eprintln!("could not forget idem's bookkeeping: {e}");
            }
        }
    }
}

fn main() -> Res<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let cfg = Config::from_env();
        let connect = PgConnectOptions::from_str(&cfg.url)?.application_name("idem-bench");
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(connect.clone())
            .await?;
        let mut tables = Tables {
            admin: admin.clone(),
            idem: Vec::new(),
            plain: Vec::new(),
        };
        let out = bench(&cfg, &connect, &mut tables).await;
        tables.drop_all().await;
        out
    })
}

async fn bench(cfg: &Config, connect: &PgConnectOptions, tables: &mut Tables) -> Res<()> {
    let admin = tables.admin.clone();
    let server: String = sqlx::query_scalar(
        "SELECT format('Server: PostgreSQL %s, synchronous_commit=%s, ssl=%s, %s cores here.',
            current_setting('server_version'), current_setting('synchronous_commit'),
            current_setting('ssl'), $1::text)",
    )
    .bind(
        std::thread::available_parallelism()
            .map_or(0, |n| n.get())
            .to_string(),
    )
    .fetch_one(&admin)
    .await?;
    let args: Vec<String> = std::env::args().collect();
    println!("idem PostgreSQL benchmark: cargo bench --bench pg");
    println!("binary: {}", args.join(" "));
    println!("{server}");
    let pgbench = find_pgbench();
    if pgbench.is_none() {
        println!("pgbench not found: the floor columns stay empty");
    }

    let idem_pool = cfg.pool().connect_with(connect.clone()).await?;
    let base_pool = cfg.pool().connect_with(connect.clone()).await?;
    let mut idem_table = |phase: &str| {
        let t = cfg.table(phase);
        tables.idem.push(t.clone());
        t
    };
    let names = ["fresh1", "fresh16", "replay", "tx", "cnt", "cnt16", "cnttx"].map(&mut idem_table);
    let [fresh1, fresh16, replay, tx, cnt, cnt16, cnttx] = names;
    let mut base_table = |phase: &str| {
        let t = cfg.table(phase);
        tables.plain.push(t.clone());
        t
    };
    let base_names = ["b_fresh1", "b_fresh16", "b_replay", "b_cnt", "b_cnt16"].map(&mut base_table);
    let [b_fresh1, b_fresh16, b_replay, b_cnt, b_cnt16] = base_names;
    let orders_idem = tables.create(ORDERS_DDL, cfg.table("orders")).await?;
    let orders_base = tables.create(ORDERS_DDL, cfg.table("b_orders")).await?;
    let orders_cnt = tables.create(ORDERS_DDL, cfg.table("orders_cnt")).await?;
    let orders_bcnt = tables.create(ORDERS_DDL, cfg.table("b_orders_cnt")).await?;

    // Counted first: short, and it checks the baseline's SQL before the long phases.
    println!("counting statements through the wire proxy...");
    let wire = Arc::new(Wire::default());
    let proxy = spawn_proxy(
        connect.get_host().to_owned(),
        connect.get_port(),
        wire.clone(),
    )
    .await?;
    let proxied = connect
        .clone()
        .host("127.0.0.1")
        .port(proxy)
        .ssl_mode(PgSslMode::Disable);
    let counter = Counter {
        admin: admin.clone(),
        pool: cfg.pool().connect_with(proxied.clone()).await?,
        wire: wire.clone(),
    };
    let mut counts = Vec::new();
    for (c, it, bt) in [(1, &cnt, &b_cnt), (16, &cnt16, &b_cnt16)] {
        let i = Arc::new(Subject::idem(cfg, &counter.pool, it.clone(), &orders_cnt).await?);
        let b = Arc::new(Subject::sqlx(&admin, &counter.pool, bt.clone(), &orders_bcnt).await?);
        let (i_from, b_from) = (i.seq.load(Ordering::Relaxed), b.seq.load(Ordering::Relaxed));
        let fresh = (
            counter.count(&i, Phase::Fresh, c).await?,
            counter.count(&b, Phase::Fresh, c).await?,
        );
        let replay = |from| Phase::Replay {
            from,
            keys: 2 * COUNTED,
        };
        let replay = (
            counter.count(&i, replay(i_from), c).await?,
            counter.count(&b, replay(b_from), c).await?,
        );
        counts.push((fresh, replay));
    }
    let tx_counts = {
        let i = Arc::new(Subject::idem(cfg, &counter.pool, cnttx.clone(), &orders_cnt).await?);
        let b = Arc::new(Subject::sqlx(&admin, &counter.pool, b_cnt.clone(), &orders_bcnt).await?);
        (
            counter.count(&i, Phase::Tx, 16).await?,
            counter.count(&b, Phase::Tx, 16).await?,
        )
    };
    counter.pool.close().await;

    let mut lines = Vec::new();
    for (label, c, it, bt) in [
        ("fresh c=1", 1, fresh1, b_fresh1),
        ("fresh c=16", 16, fresh16, b_fresh16.clone()),
    ] {
        println!("{label}...");
        let i = Arc::new(Subject::idem(cfg, &idem_pool, it, &orders_idem).await?);
        let b = Arc::new(Subject::sqlx(&admin, &base_pool, bt, &orders_base).await?);
        let (idem, base) = ab(cfg, &i, &b, (Phase::Fresh, Phase::Fresh), c).await?;
        lines.push(Line {
            label,
            idem,
            base,
            ..Line::default()
        });
    }

    println!("recording {REPLAY_KEYS} keys to replay...");
    let i = Arc::new(Subject::idem(cfg, &idem_pool, replay.clone(), &orders_idem).await?);
    let b = Arc::new(Subject::sqlx(&admin, &base_pool, b_replay.clone(), &orders_base).await?);
    drive(&i, Phase::Fresh, 16, Stop::Ops(REPLAY_KEYS)).await?;
    drive(&b, Phase::Fresh, 16, Stop::Ops(REPLAY_KEYS)).await?;
    let vacuum = format!("VACUUM ANALYZE {}, {}", quoted(&replay), quoted(&b_replay));
    admin.execute(vacuum.as_str()).await?;
    let keys = Phase::Replay {
        from: 0,
        keys: REPLAY_KEYS,
    };
    for (label, c) in [("replay c=1", 1), ("replay c=16", 16)] {
        println!("{label}...");
        let runs = (
            i.runs.load(Ordering::Relaxed),
            b.runs.load(Ordering::Relaxed),
        );
        let (idem, base) = ab(cfg, &i, &b, (keys, keys), c).await?;
        if i.runs.load(Ordering::Relaxed) != runs.0 || b.runs.load(Ordering::Relaxed) != runs.1 {
            return Err("a replay ran the body".into());
        }
        lines.push(Line {
            label,
            idem,
            base,
            ..Line::default()
        });
    }

    println!("tx fresh c=16...");
    let i = Arc::new(Subject::idem(cfg, &idem_pool, tx, &orders_idem).await?);
    let b = Arc::new(Subject::sqlx(&admin, &base_pool, b_fresh16.clone(), &orders_base).await?);
    let (idem, base) = ab(cfg, &i, &b, (Phase::Tx, Phase::Tx), 16).await?;
    lines.push(Line {
        label: "tx fresh c=16",
        idem,
        base,
        ..Line::default()
    });
    idem_pool.close().await;
    base_pool.close().await;

    let [(f1, r1), (f16, r16)]: [_; 2] = counts
        .try_into()
        .map_err(|_| "two concurrency levels were counted")?;
    let mut counted = [Some(f1), Some(f16), Some(r1), Some(r16), Some(tx_counts)];
    for (line, count) in lines.iter_mut().zip(&mut counted) {
        line.count = count.take();
    }

    if let Some(bin) = pgbench.as_deref() {
        println!("pgbench floor...");
        let floor_fresh = tables.create(FLOOR_DDL, cfg.table("pgb_fresh")).await?;
        let floor_replay = tables.create(FLOOR_DDL, cfg.table("pgb_replay")).await?;
        let floor_tx = tables.create(FLOOR_DDL, cfg.table("pgb_tx")).await?;
        let floor_orders = tables.create(ORDERS_DDL, cfg.table("pgb_orders")).await?;
        let populate = format!(
            "INSERT INTO {} SELECT '', 'bench', g::text, '\\x31' FROM generate_series(1, {REPLAY_KEYS}) g",
            quoted(&floor_replay)
        );
        admin.execute(populate.as_str()).await?;
        let vacuum = format!("VACUUM ANALYZE {}", quoted(&floor_replay));
        admin.execute(vacuum.as_str()).await?;
        let fill = |script: &str, table: &str| {
            script
                .replace("{table}", &quoted(table))
                .replace("{orders}", &quoted(&floor_orders))
                .replace("{rows}", &REPLAY_KEYS.to_string())
        };
        let floors = [
            Floor {
                bin,
                name: "fresh",
                script: fill(FRESH_SQL, &floor_fresh),
            },
            Floor {
                bin,
                name: "replay",
                script: fill(REPLAY_SQL, &floor_replay),
            },
            Floor {
                bin,
                name: "tx",
                script: fill(TX_SQL, &floor_tx),
            },
        ];
        let counter = Arc::new(Wire::default());
        let port = spawn_proxy(
            connect.get_host().to_owned(),
            connect.get_port(),
            counter.clone(),
        )
        .await?;
        let mut per_script = Vec::new();
        for floor in &floors {
            per_script.push(floor.count(connect, port, &counter)?);
        }
        for (line, (script, clients)) in
            lines
                .iter_mut()
                .zip([(0, 1), (0, 16), (1, 1), (1, 16), (2, 16)])
        {
            line.floor = Some(floors[script].tps(&cfg.url, clients, cfg.pgbench_secs)?);
            line.floor_count = Some(per_script[script]);
        }
    }

    print_report(cfg, &lines, &server);
    let (io, bo) = (orders_cnt.as_str(), orders_bcnt.as_str());
    let renames = |it, bt| Renames {
        idem: [(it, "T"), (io, "O")],
        base: [(bt, "T"), (bo, "O")],
    };
    compare_sql(
        &lines,
        &[
            renames(&cnt, &b_cnt),
            renames(&cnt16, &b_cnt16),
            renames(&cnt, &b_cnt),
            renames(&cnt16, &b_cnt16),
            renames(&cnttx, &b_cnt),
        ],
    );
    Ok(())
}
