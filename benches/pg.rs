//! The PostgreSQL benchmark: idem against the same SQL issued directly through sqlx, and
//! against the pgbench floor (the fewest statements that give the same guarantee).
//!
//! ```text
//! cargo bench -p idem-tests --bench pg
//! ```
//!
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! `pgbench` on the `PATH` or under `/usr/lib/postgresql/*/bin`. Every table is new,
//! named after this process, and dropped at the end. Knobs, all optional:
//! `IDEM_BENCH_SECS` (one measurement, default 2), `IDEM_BENCH_ROUNDS` (A/B rounds, default
//! 3), `IDEM_BENCH_PGBENCH_SECS` (default 5), `IDEM_BENCH_NO_PING=1` (pools without sqlx's
//! ping on acquire), `IDEM_BENCH_NO_RENEW=1` (idem without its lease renewal task),
//! `IDEM_BENCH_EXPERIMENTS=1` (where the time goes: idem and the baseline on a pool
//! without the acquire ping, idem without lease renewal, the baseline on one held
//! connection per task, transactional mode's statements issued by sqlx, and pgbench
//! running idem's own SQL; about three minutes with `IDEM_BENCH_SECS=1.5`).
//!
//! The baseline's SQL is rendered by the store's own engine from `idem-runtime/sql/postgres/`,
//! so it is the store's SQL as built; the counted run checks on the wire that idem sends it.
//! Statements and round trips per operation are counted by a small TCP proxy that reads
//! the client's protocol messages (each `Query` or `Execute` is a statement; each `Sync`
//! or `Query` a round trip); `pg_stat_database.xact_commit` and `pg_stat_user_tables`
//! cross-check them on the server.

use std::collections::{BTreeMap, HashMap};
use std::error::Error;
use std::process::Command;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError, KeyPart, OperationId, TxStep};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::postgres::{PgRow, PgSslMode};
use sqlx::{Executor, Postgres, Row};
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
/// Any fixed fingerprint: the baseline binds 32 bytes, as idem does.
const FINGERPRINT: [u8; 32] = [7; 32];

const FRESH_SQL: &str = include_str!("pgbench/fresh.sql");
const REPLAY_SQL: &str = include_str!("pgbench/replay.sql");
const TX_SQL: &str = include_str!("pgbench/tx.sql");

/// The floor's table: idem's key and an outcome, nothing else.
const FLOOR_DDL: &str = "CREATE TABLE {table} (scope TEXT NOT NULL, name TEXT NOT NULL,
    key TEXT NOT NULL, outcome BYTEA, PRIMARY KEY (scope, name, key))";
const ORDERS_DDL: &str = "CREATE TABLE {table} (id TEXT PRIMARY KEY, qty BIGINT NOT NULL)";

/// The store's statements, rendered by the store's own engine from its `.sql` files.
struct Templates;

impl Templates {
    fn load() -> Res<Templates> {
        Ok(Templates)
    }

    fn render(&self, table: &str) -> Sql {
        let r = |name: &str| {
            idem_runtime::store::bench::postgres_statement(name, table)
                .expect("idem's statements render for the bench's table")
        };
        Sql {
            peek: r("peek"),
            claim: r("claim"),
            claim_fresh: r("claim_fresh"),
            record: r("record"),
            tx_claim: r("tx_claim"),
            tx_record: r("tx_record"),
            claim_batch: r("claim_batch"),
            record_batch: r("record_batch"),
        }
    }
}

/// The store's statements for one table.
#[derive(Clone)]
struct Sql {
    peek: String,
    claim: String,
    claim_fresh: String,
    record: String,
    tx_claim: String,
    tx_record: String,
    claim_batch: String,
    record_batch: String,
}

struct Config {
    url: String,
    measure: Duration,
    rounds: usize,
    pgbench_secs: u64,
    ping: bool,
    renew: bool,
    experiments: bool,
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
            experiments: set("IDEM_BENCH_EXPERIMENTS"),
            prefix: format!("idem_bench_{}", std::process::id()),
        }
    }

    /// The same pool for idem and for the baseline: sqlx's defaults, big enough.
    fn pool(&self) -> PgPoolOptions {
        PgPoolOptions::new()
            .max_connections(POOL)
            .min_connections(POOL)
            .test_before_acquire(self.ping)
    }
}

fn quoted(table: &str) -> String {
    format!("\"{table}\"")
}

/// The tables of one run, dropped at the end.
struct Tables {
    admin: PgPool,
    prefix: String,
    idem: Vec<String>,
    plain: Vec<String>,
}

impl Tables {
    /// A table name for idem to create (and migrate) itself.
    fn idem(&mut self, phase: &str) -> String {
        let table = format!("{}_{phase}", self.prefix);
        self.idem.push(table.clone());
        table
    }

    /// A new table from `ddl`, which names it `{table}` (quoted) or `{bare}`.
    async fn create(&mut self, ddl: &str, phase: &str) -> Res<String> {
        let table = format!("{}_{phase}", self.prefix);
        self.plain.push(table.clone());
        let ddl = ddl
            .replace("{table}", &quoted(&table))
            .replace("{bare}", &table);
        let sql = format!("DROP TABLE IF EXISTS {}; {ddl}", quoted(&table));
        sqlx::raw_sql(&sql).execute(&self.admin).await?;
        Ok(table)
    }

    /// A table shaped as idem's, from idem's shipped schema (its indexes renamed too).
    async fn idem_shaped(&mut self, phase: &str) -> Res<String> {
        let ddl = idem_runtime::schema::POSTGRES_SCHEMA_SQL.replace("idem_operations", "{bare}");
        self.create(&ddl, phase).await
    }

    async fn drop_all(&self) {
        for table in self.idem.iter().chain(&self.plain) {
            let drop = format!("DROP TABLE IF EXISTS {}", quoted(table));
            if let Err(e) = self.admin.execute(drop.as_str()).await {
                eprintln!("could not drop {table}: {e}");
            }
        }
        let bookkeeping: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('idem_schema_migrations')::text")
                .fetch_one(&self.admin)
                .await
                .unwrap_or(None);
        if bookkeeping.is_some() {
            let forgot =
                sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = ANY($1)")
                    .bind(&self.idem)
                    .execute(&self.admin)
                    .await;
            if let Err(e) = forgot {
                eprintln!("could not forget idem's bookkeeping: {e}");
            }
        }
    }
}

enum Side {
    Idem(Idem),
    /// The store's SQL through sqlx; `held`: on one connection per task instead of a
    /// pool acquire per statement.
    Sqlx {
        sql: Sql,
        held: bool,
    },
    /// Transactional mode's statements through sqlx, in a plain transaction; `savepoint`:
    /// with idem's savepoint around them.
    SqlxTx {
        sql: Sql,
        savepoint: bool,
    },
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
    /// Where this subject's fresh keys of the 50% mix start: subjects that share the
    /// replay table must not draw each other's.
    mix_base: u64,
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
    /// Half replays of the keys `from..from + keys`, half fresh keys.
    Mix {
        from: u64,
        keys: u64,
    },
}

/// Where the mix's fresh keys start, past every key recorded to replay.
const MIX_FRESH: u64 = 1 << 40;
/// Subjects made so far, for their [`Subject::mix_base`].
static SUBJECTS: AtomicU64 = AtomicU64::new(0);

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

const IDEM: &str = "idem";
const SQLX: &str = "sqlx baseline";
const IDEM_OWN: &str = "idem on its own connections (Idem::postgres)";
const IDEM_QUIET: &str = "idem, pool without the acquire ping";
const IDEM_NO_RENEW: &str = "idem, no lease renewal task";
const SQLX_QUIET: &str = "sqlx, pool without the acquire ping";
const SQLX_HELD: &str = "sqlx, one held connection per task";
const SQLX_TX: &str = "sqlx, idem's transactional statements";
const SQLX_TX_NO_SAVEPOINT: &str = "sqlx, the same without the savepoint";

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// idem on the bench's table, with lease renewal as asked and the in-process replay
/// cache off: the replay rows measure the store's path (a retry reaching the same
/// process would not reach the database at all).
fn idem_builder(renew: bool, table: &str) -> idem_runtime::IdemBuilder {
    Idem::builder()
        .table(table)
        .renew_leases(renew)
        .replay_cache_bytes(0)
}

impl Subject {
    async fn idem(cfg: &Config, pool: &PgPool, table: String, orders: &str) -> Res<Arc<Subject>> {
        Subject::idem_renewing(cfg.renew, pool, table, orders).await
    }

    async fn idem_renewing(
        renew: bool,
        pool: &PgPool,
        table: String,
        orders: &str,
    ) -> Res<Arc<Subject>> {
        let idem = idem_builder(renew, &table).pool(pool.clone()).await?;
        Ok(Subject::new(Side::Idem(idem), pool, table, orders))
    }

    /// idem as `Idem::postgres` builds it: claims and records on connections it holds
    /// itself, outside any sqlx pool (as many as the pools have).
    async fn idem_own(
        cfg: &Config,
        pool: &PgPool,
        table: String,
        orders: &str,
    ) -> Res<Arc<Subject>> {
        let idem = idem_builder(cfg.renew, &table)
            .max_connections(POOL)
            .postgres(&cfg.url)
            .await?;
        Ok(Subject::new(Side::Idem(idem), pool, table, orders))
    }

    fn sqlx(
        sql: &Templates,
        pool: &PgPool,
        table: String,
        orders: &str,
        held: bool,
    ) -> Arc<Subject> {
        let sql = sql.render(&table);
        Subject::new(Side::Sqlx { sql, held }, pool, table, orders)
    }

    fn new(side: Side, pool: &PgPool, table: String, orders: &str) -> Arc<Subject> {
        Arc::new(Subject {
            side,
            pool: pool.clone(),
            table,
            order: format!("INSERT INTO {} (id, qty) VALUES ($1, $2)", quoted(orders)),
            seq: AtomicU64::new(0),
            mix_base: MIX_FRESH + (SUBJECTS.fetch_add(1, Ordering::Relaxed) << 32),
            runs: AtomicU64::new(0),
        })
    }

    fn held(&self) -> bool {
        matches!(self.side, Side::Sqlx { held: true, .. })
    }

    async fn call(&self, phase: Phase, i: u64, mut conn: Option<&mut PgConnection>) -> Res<()> {
        let key = match phase {
            Phase::Replay { from, keys } => key(from + i % keys),
            Phase::Mix { from, keys } if i.is_multiple_of(2) => key(from + (i / 2) % keys),
            Phase::Mix { .. } => key(self.mix_base + i),
            Phase::Fresh | Phase::Tx => key(i),
        };
        match (&self.side, phase) {
            (Side::Idem(idem), Phase::Fresh | Phase::Replay { .. } | Phase::Mix { .. }) => {
                let got = idem
                    .operation(NAME, &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(|| async {
                        self.runs.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, IdemError>(1u32)
                    })
                    .await?;
                check(got == 1, "idem returned another outcome")
            }
            (Side::Idem(idem), Phase::Tx) => {
                let mut tx = self.pool.begin().await?;
                let step: TxStep<u32, TxError, _> = idem
                    .operation(NAME, &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .begin_tx(&mut tx)
                    .await?;
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
            (Side::Sqlx { sql, .. }, Phase::Fresh) => self.fresh(sql, &key, &mut conn).await,
            (Side::Sqlx { sql, .. }, Phase::Mix { .. }) if !i.is_multiple_of(2) => {
                self.fresh(sql, &key, &mut conn).await
            }
            (Side::Sqlx { sql, .. }, Phase::Replay { .. } | Phase::Mix { .. }) => {
                self.replay(sql, &key, &mut conn).await
            }
            (Side::SqlxTx { sql, savepoint }, _) => self.tx(sql, *savepoint, &key).await,
            (Side::Sqlx { .. }, Phase::Tx) => {
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

    async fn fetch(&self, query: Query<'_>, conn: &mut Option<&mut PgConnection>) -> Res<PgRow> {
        let row = match conn {
            Some(c) => query.fetch_optional(&mut **c).await?,
            None => query.fetch_optional(&self.pool).await?,
        };
        Ok(row.ok_or("the statement returned no row")?)
    }

    /// What idem does for a fresh key, minus idem: the claim of a new key (a plain
    /// insert), then the record.
    async fn fresh(&self, sql: &Sql, key: &str, conn: &mut Option<&mut PgConnection>) -> Res<()> {
        let id = operation_id(key);
        let claim = sqlx::query(&sql.claim_fresh)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..])
            .bind(LEASE_MS);
        let claim = self.fetch(claim, conn).await?;
        let epoch: i64 = claim.try_get("epoch")?;
        self.runs.fetch_add(1, Ordering::Relaxed);
        let record = sqlx::query(&sql.record)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(serde_json::to_vec(&1u32)?)
            .bind(false)
            .bind(1_i32)
            .bind(RETAIN_MS);
        let recorded = self.fetch(record, conn).await?;
        check(
            recorded.try_get::<i64, _>("held")? == 1,
            "the record was fenced",
        )
    }

    /// What idem does for a fresh key in transactional mode, minus idem.
    async fn tx(&self, sql: &Sql, savepoint: bool, key: &str) -> Res<()> {
        let id = operation_id(key);
        let mut tx = self.pool.begin().await?;
        if savepoint {
            sqlx::query("SAVEPOINT idem_body").execute(&mut *tx).await?;
        }
        let claimed = sqlx::query(&sql.tx_claim)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..])
            .bind(LEASE_MS)
            .fetch_optional(&mut *tx)
            .await?;
        check(claimed.is_some(), "the transactional claim was not ours")?;
        self.runs.fetch_add(1, Ordering::Relaxed);
        sqlx::query(&self.order)
            .bind(key)
            .bind(1_i64)
            .execute(&mut *tx)
            .await?;
        let recorded = sqlx::query(&sql.tx_record)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(serde_json::to_vec(&1u32)?)
            .bind(false)
            .bind(1_i32)
            .bind(RETAIN_MS)
            .execute(&mut *tx)
            .await?;
        check(recorded.rows_affected() == 1, "the record found no claim")?;
        if savepoint {
            sqlx::query("RELEASE SAVEPOINT idem_body")
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// What idem does for a replay once replays come in, minus idem: the read of a
    /// completed record.
    async fn replay(&self, sql: &Sql, key: &str, conn: &mut Option<&mut PgConnection>) -> Res<()> {
        let id = operation_id(key);
        let peek = sqlx::query(&sql.peek)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..]);
        let row = self.fetch(peek, conn).await?;
        check(row.try_get::<bool, _>("same_fingerprint")?, "mismatch")?;
        let outcome: Vec<u8> = row.try_get("outcome")?;
        check(
            serde_json::from_slice::<u32>(&outcome)? == 1,
            "another outcome",
        )
    }
}

fn operation_id(key: &str) -> OperationId {
    OperationId {
        scope: String::new(),
        name: NAME.into(),
        key: key.encode_key(),
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
                let mut held = if subject.held() {
                    Some(subject.pool.acquire().await?)
                } else {
                    None
                };
                while deadline.is_none_or(|d| Instant::now() < d) {
                    let i = subject.seq.fetch_add(1, Ordering::Relaxed);
                    if limit.is_some_and(|l| i >= l) {
                        break;
                    }
                    subject.call(phase, i, held.as_deref_mut()).await?;
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
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A subject measured in one row, named for the report.
type Contender = (&'static str, Arc<Subject>, Phase);

/// Each subject in turn (idem, baseline, idem, baseline, ...), after a short warm-up of
/// each; the rounds of each subject.
async fn rounds(
    cfg: &Config,
    subjects: &[Contender],
    concurrency: usize,
) -> Res<Vec<(&'static str, Vec<f64>)>> {
    let warm = Duration::from_millis(300);
    for (_, subject, phase) in subjects {
        drive(subject, *phase, concurrency, Stop::After(warm)).await?;
    }
    let mut out: Vec<_> = subjects.iter().map(|s| (s.0, Vec::new())).collect();
    for _ in 0..cfg.rounds {
        for ((_, subject, phase), (_, out)) in subjects.iter().zip(&mut out) {
            out.push(drive(subject, *phase, concurrency, Stop::After(cfg.measure)).await?);
        }
    }
    Ok(out)
}

/// What the client sent through the counting proxy.
#[derive(Default)]
struct Wire {
    queries: AtomicU64,
    executes: AtomicU64,
    syncs: AtomicU64,
    parses: AtomicU64,
    /// Statements executed, by text.
    executed: Mutex<BTreeMap<String, u64>>,
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

    /// Each `Sync` and each simple `Query` waits for the server. A `Parse` (a statement
    /// prepared on this connection for the first time) costs one of them, which a warm
    /// statement cache does not pay, so it is not counted.
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

    fn take_executed(&self) -> BTreeMap<String, u64> {
        std::mem::take(&mut *self.executed.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn execute(&self, sql: &str) {
        let mut executed = self.executed.lock().unwrap_or_else(|p| p.into_inner());
        *executed.entry(sql.to_owned()).or_default() += 1;
    }
}

/// The NUL-terminated strings at the start of a message body.
fn cstrings(body: &[u8]) -> impl Iterator<Item = String> + '_ {
    body.split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
}

/// Splits one client connection's byte stream into protocol messages.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
    started: bool,
    broken: bool,
    /// Prepared statements by name, to know what a `Bind` executes.
    prepared: HashMap<String, String>,
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
            let (head, len_at) = if self.started { (5, 1) } else { (8, 0) };
            if rest.len() < head {
                break;
            }
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
                let (tag, body) = (rest[0], &rest[5..total]);
                let counter = match tag {
                    b'Q' => Some(&wire.queries),
                    b'E' => Some(&wire.executes),
                    b'S' => Some(&wire.syncs),
                    b'P' => Some(&wire.parses),
                    _ => None,
                };
                if let Some(counter) = counter {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                let mut strings = cstrings(body);
                match tag {
                    b'Q' => wire.execute(&strings.next().unwrap_or_default()),
                    b'P' => {
                        let name = strings.next().unwrap_or_default();
                        let sql = strings.next().unwrap_or_default();
                        self.prepared.insert(name, sql);
                    }
                    b'B' => {
                        let statement = strings.nth(1).unwrap_or_default();
                        let sql = self.prepared.get(&statement).map_or("?", String::as_str);
                        wire.execute(sql);
                    }
                    _ => {}
                }
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

/// Per operation, in one counted run.
struct Count {
    statements: f64,
    round_trips: f64,
    /// Server transactions (`xact_commit`), from the statistics.
    xacts: f64,
    /// Rows inserted, updated or deleted in the subject's table (statistics).
    writes: i64,
    /// Bodies run, or claims won.
    runs: u64,
    /// Each statement executed, by text, and how often per operation.
    executed: BTreeMap<String, f64>,
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
        drive(subject, phase, concurrency, Stop::Ops(COUNTED)).await?;
        self.flush_stats().await?;
        let writes = table_writes(&self.admin, &subject.table).await?;
        let xacts = xact_commits(&self.admin).await?;
        let runs = subject.runs.load(Ordering::Relaxed);
        self.wire.take_executed();
        let before = self.wire.tally();
        drive(subject, phase, concurrency, Stop::Ops(COUNTED)).await?;
        let tally = self.wire.tally().since(before);
        let executed = self.wire.take_executed();
        let flushes = self.flush_stats().await?;
        let xacts = xact_commits(&self.admin).await? - xacts - flushes;
        let per = |n: u64| n as f64 / COUNTED as f64;
        Ok(Count {
            statements: per(tally.statements()),
            round_trips: per(tally.round_trips()),
            xacts: xacts as f64 / COUNTED as f64,
            writes: table_writes(&self.admin, &subject.table).await? - writes,
            runs: subject.runs.load(Ordering::Relaxed) - runs,
            executed: executed.into_iter().map(|(k, n)| (k, per(n))).collect(),
        })
    }
}

/// Settles freshly written tables (visibility map, statistics) before they are read.
async fn vacuum(admin: &PgPool, tables: &[&str]) -> Res<()> {
    let names: Vec<_> = tables.iter().map(|t| quoted(t)).collect();
    let sql = format!("VACUUM ANALYZE {}", names.join(", "));
    admin.execute(sql.as_str()).await?;
    Ok(())
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

/// One pgbench script, placeholders filled in.
struct Floor<'a> {
    bin: &'a str,
    name: &'static str,
    script: String,
    /// `-D name=value` variables.
    vars: Vec<String>,
}

impl Floor<'_> {
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Res<String> {
        let path = std::env::temp_dir().join(format!(
            "idem-bench-{}-{}.sql",
            std::process::id(),
            self.name
        ));
        std::fs::write(&path, &self.script)?;
        let mut cmd = Command::new(self.bin);
        cmd.args(["-n", "-M", "prepared", "-f"]).arg(&path);
        for var in &self.vars {
            cmd.arg("-D").arg(var);
        }
        let out = cmd.args(args).envs(env.iter().copied()).output();
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
        let mut tries = 0;
        let out = loop {
            match self.run(&["-c", &c, "-j", "2", "-T", &t, url], &[]) {
                // Connections the bench just dropped may not have ended on the server yet.
                Err(e) if e.to_string().contains("too many clients") && tries < 5 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_secs(1));
                }
                out => break out?,
            }
        };
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
        let (port, t) = (port.to_string(), TRANSACTIONS.to_string());
        let mut args = vec!["-c", "1", "-t", &t, "-h", "127.0.0.1", "-p", &port];
        args.extend(["-U", connect.get_username()]);
        args.extend(connect.get_database());
        self.run(&args, &[("PGSSLMODE", "disable")])?;
        let tally = wire.tally().since(before);
        let per = |n: u64| n as f64 / TRANSACTIONS as f64;
        Ok((per(tally.statements()), per(tally.round_trips())))
    }
}

/// idem's own statements as a pgbench script (the claim of a new key and the record;
/// for replays, the read of the completed record): the same statements, with pgbench
/// variables for the parameters (typed, as sqlx binds them) and `\gset` to carry the
/// epoch.
fn idem_sql_script(sql: &Sql, replay: bool) -> String {
    let vars = [
        ("$1", ":scope::text"),
        ("$2", ":name::text"),
        ("$3", ":k::text"),
        ("$4", ":fp::bytea"),
        ("$5", ":lease"),
        ("$6", ":unknown::boolean"),
    ];
    if replay {
        let peek = vars
            .iter()
            .fold(sql.peek.clone(), |s, (p, v)| s.replace(p, v));
        return format!("\\set k random(1, {REPLAY_KEYS})\n{peek};\n");
    }
    let claim = vars
        .iter()
        .fold(sql.claim_fresh.clone(), |s, (p, v)| s.replace(p, v));
    let record = [
        ("$1", ":scope::text"),
        ("$2", ":name::text"),
        ("$3", ":k::text"),
        ("$4", ":c_epoch::bigint"),
        ("$5", ":outcome::bytea"),
        ("$6", ":is_err::boolean"),
        ("$7", ":version::integer"),
        ("$8", ":retain"),
    ]
    .iter()
    .fold(sql.record.clone(), |s, (p, v)| s.replace(p, v));
    // The claim's columns go to `c_*` variables, clear of the record's parameters. Keys
    // from a range where none repeats: the claim of a new key returns no row for one.
    format!("\\set k random(1, 9000000000000000000)\n{claim} \\gset c_\n{record};\n")
}

fn idem_sql_vars() -> Vec<String> {
    let hex: String = FINGERPRINT.iter().map(|b| format!("{b:02x}")).collect();
    vec![
        "scope=p".into(),
        format!("name={NAME}"),
        format!("fp=\\x{hex}"),
        format!("lease={LEASE_MS}"),
        "unknown=false".into(),
        "payload={\"scope\":\"p\",\"name\":\"bench\",\"key\":\"k\"}".into(),
        "outcome=\\x31".into(),
        "is_err=false".into(),
        "version=1".into(),
        format!("retain={RETAIN_MS}"),
    ]
}

const FRESH: usize = 0;
const REPLAY: usize = 1;
const TX: usize = 2;
/// No pgbench floor: the 50% duplicate mix.
const MIX: usize = 3;

/// One row of the report.
struct Line {
    label: &'static str,
    concurrency: usize,
    /// Which pgbench script is its floor: [`FRESH`], [`REPLAY`] or [`TX`]; none for
    /// [`MIX`].
    script: usize,
    /// Rounds of idem, of the baseline, then of the experiments.
    rounds: Vec<(&'static str, Vec<f64>)>,
    floor: Option<f64>,
    /// pgbench running idem's SQL (experiments).
    floor_idem_sql: Option<f64>,
    count: Option<(Count, Count)>,
    floor_count: Option<(f64, f64)>,
}

impl Line {
    fn new(label: &'static str, concurrency: usize, script: usize) -> Line {
        Line {
            label,
            concurrency,
            script,
            rounds: Vec::new(),
            floor: None,
            floor_idem_sql: None,
            count: None,
            floor_count: None,
        }
    }

    fn median(&self, label: &str) -> Option<f64> {
        self.rounds
            .iter()
            .find(|(l, _)| *l == label)
            .map(|(_, r)| median(r))
    }
}

fn fmt_opt(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "—".into(), |x| format!("{x:.digits$}"))
}

fn ratio(a: Option<f64>, b: Option<f64>, goal: f64) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => {
            let r = a / b;
            format!("{r:.2}{}", if r >= goal { "" } else { " ✗" })
        }
        _ => "—".into(),
    }
}

/// A statement's text on one line, with the tables named `T` (idem's) and `O` (orders).
fn describe(sql: &str, names: &[(&str, &str)], known: &[(&str, &Sql)]) -> String {
    let sql = names
        .iter()
        .fold(sql.to_owned(), |s, (from, to)| s.replace(&quoted(from), to));
    for (table, statements) in known {
        let rename = |s: &str| s.replace(&quoted(table), "T");
        for (name, text) in [
            ("PEEK", &statements.peek),
            ("CLAIM", &statements.claim),
            ("CLAIM_FRESH", &statements.claim_fresh),
            ("RECORD", &statements.record),
            ("TX_CLAIM", &statements.tx_claim),
            ("TX_RECORD", &statements.tx_record),
            ("CLAIM_BATCH", &statements.claim_batch),
            ("RECORD_BATCH", &statements.record_batch),
        ] {
            if rename(text) == sql {
                return name.into();
            }
        }
    }
    let flat = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(48) {
        Some((at, _)) => format!("{}…", &flat[..at]),
        None => flat,
    }
}

struct Report<'a> {
    cfg: &'a Config,
    server: String,
    lines: Vec<Line>,
    /// Per counted line: idem's table, the baseline's, and the orders tables.
    names: Vec<[(String, &'static str); 4]>,
    templates: Templates,
}

impl Report<'_> {
    fn print(&self) {
        let cfg = self.cfg;
        println!();
        println!(
            "| phase | idem ops/s | sqlx baseline ops/s | idem/sqlx | pgbench floor tps | \
             idem/pgbench | Idem::postgres ops/s | Idem::postgres/pgbench | \
             statements/op idem (sqlx, floor) | round trips/op idem (sqlx, floor) |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---|");
        for line in &self.lines {
            let (idem, base) = (line.median(IDEM), line.median(SQLX));
            let own = line.median(IDEM_OWN);
            let (stmts, trips) = match &line.count {
                Some((i, b)) => {
                    let f = |x: Option<f64>| fmt_opt(x, 2);
                    let floor = line.floor_count;
                    let added = if line.script == TX {
                        format!("; idem adds {:.2}", i.statements - b.statements)
                    } else {
                        String::new()
                    };
                    (
                        format!(
                            "{:.2} ({:.2}, {}){added}",
                            i.statements,
                            b.statements,
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
                None => ("—".into(), "—".into()),
            };
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {stmts} | {trips} |",
                line.label,
                fmt_opt(idem, 0),
                fmt_opt(base, 0),
                ratio(idem, base, 0.9),
                fmt_opt(line.floor, 0),
                ratio(idem, line.floor, 0.8),
                fmt_opt(own, 0),
                ratio(own, line.floor, 0.8),
            );
        }
        println!();
        println!(
            "Medians of {} rounds of {:.1}s, idem and sqlx alternating; pgbench -T {} -j 2 -n \
             -M prepared right after each row. ✗: below the goal (idem/sqlx ≥ 0.9, \
             idem/pgbench ≥ 0.8).",
            cfg.rounds,
            cfg.measure.as_secs_f64(),
            cfg.pgbench_secs
        );
        println!("{}", self.server);
        println!(
            "Pools: {POOL} connections each, sqlx defaults otherwise (test_before_acquire({})); \
             idem lease renewal {}.",
            cfg.ping,
            if cfg.renew { "on" } else { "off" }
        );
        println!();
        println!("Rounds (ops/s):");
        for line in &self.lines {
            for (i, (label, r)) in line.rounds.iter().enumerate() {
                let r: Vec<_> = r.iter().map(|x| format!("{x:.0}")).collect();
                let phase = if i == 0 { line.label } else { "" };
                println!("  {phase:<13} {label:<44} [{}]", r.join(", "));
            }
        }
        self.print_counts();
        if cfg.experiments {
            self.print_experiments();
        }
    }

    fn print_counts(&self) {
        println!();
        println!(
            "Counted runs through the wire proxy ({COUNTED} operations each, after {COUNTED} \
             to warm up); statements executed per operation:"
        );
        for (line, names) in self.lines.iter().zip(&self.names) {
            let Some((i, b)) = &line.count else { continue };
            let renames: Vec<(&str, &str)> = names.iter().map(|(t, n)| (t.as_str(), *n)).collect();
            let (idem_sql, base_sql) = (
                self.templates.render(&names[0].0),
                self.templates.render(&names[1].0),
            );
            let known = [
                (names[0].0.as_str(), &idem_sql),
                (names[1].0.as_str(), &base_sql),
            ];
            let show = |count: &Count| {
                let per: BTreeMap<String, f64> =
                    count
                        .executed
                        .iter()
                        .fold(BTreeMap::new(), |mut m, (sql, n)| {
                            *m.entry(describe(sql, &renames, &known)).or_default() += n;
                            m
                        });
                per.iter()
                    .map(|(s, n)| format!("{s} ×{n:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let (idem, base) = (show(i), show(b));
            println!("  {:<13} idem: {idem}", line.label);
            println!("  {:<13} sqlx: {base}", "");
            // Under concurrency idem gathers claims and records into batch statements.
            if line.script != TX && idem != base && !idem.contains("_BATCH") {
                println!(
                    "  {:<13} WARNING: idem and the baseline executed different statements",
                    ""
                );
            }
            println!(
                "  {:<13} server commits/op idem {:.2}, sqlx {:.2}; rows written idem {}, sqlx \
                 {}; bodies run (claims won) idem {}, sqlx {}",
                "", i.xacts, b.xacts, i.writes, b.writes, i.runs, b.runs
            );
        }
    }

    fn print_experiments(&self) {
        println!();
        println!(
            "Where the time goes (IDEM_BENCH_EXPERIMENTS=1): medians in ops/s, and their ratio \
             to idem's."
        );
        for line in &self.lines {
            let idem = line.median(IDEM);
            let mut cells: Vec<_> = line
                .rounds
                .iter()
                .map(|(label, r)| (label.to_string(), Some(median(r))))
                .collect();
            cells.push(("pgbench, idem's SQL".into(), line.floor_idem_sql));
            cells.push(("pgbench floor".into(), line.floor));
            println!("  {}", line.label);
            for (label, x) in cells.iter().filter(|c| c.1.is_some()) {
                let vs = match (x, idem) {
                    (Some(x), Some(i)) if i > 0.0 => format!("{:.2}", x / i),
                    _ => "—".into(),
                };
                println!("    {label:<46} {:>7}  ×{vs}", fmt_opt(*x, 0));
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
            prefix: cfg.prefix.clone(),
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
    let templates = Templates::load()?;
    let server: String = sqlx::query_scalar(
        "SELECT format('Server: PostgreSQL %s, synchronous_commit=%s, ssl=%s; %s cores here.',
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
    println!("idem PostgreSQL benchmark: cargo bench -p idem-tests --bench pg");
    println!("binary: {}", std::env::args().collect::<Vec<_>>().join(" "));
    println!("{server}");
    let pgbench = find_pgbench();
    if pgbench.is_none() {
        println!("pgbench not found: the floor columns stay empty");
    }
    let orders_idem = tables.create(ORDERS_DDL, "orders").await?;
    let orders_base = tables.create(ORDERS_DDL, "b_orders").await?;
    let cnt_orders = tables.create(ORDERS_DDL, "cnt_orders").await?;
    let cnt_b_orders = tables.create(ORDERS_DDL, "cnt_b_orders").await?;

    // Counted first: short, and it checks the baseline's SQL before the long phases.
    println!("counting statements through the wire proxy...");
    let wire = Arc::new(Wire::default());
    let host = connect.get_host().to_owned();
    let proxy = spawn_proxy(host.clone(), connect.get_port(), wire.clone()).await?;
    let proxied = connect
        .clone()
        .host("127.0.0.1")
        .port(proxy)
        .ssl_mode(PgSslMode::Disable);
    let counter = Counter {
        admin: admin.clone(),
        pool: cfg.pool().connect_with(proxied).await?,
        wire,
    };
    let mut counts = Vec::new();
    let mut names = Vec::new();
    for c in [1, 16] {
        let it = tables.idem(&format!("cnt{c}"));
        let bt = tables.idem_shaped(&format!("b_cnt{c}")).await?;
        let i = Subject::idem(cfg, &counter.pool, it.clone(), &cnt_orders).await?;
        let b = Subject::sqlx(&templates, &counter.pool, bt.clone(), &cnt_b_orders, false);
        let fresh = (
            counter.count(&i, Phase::Fresh, c).await?,
            counter.count(&b, Phase::Fresh, c).await?,
        );
        let replay = Phase::Replay {
            from: 0,
            keys: 2 * COUNTED,
        };
        let replay = (
            counter.count(&i, replay, c).await?,
            counter.count(&b, replay, c).await?,
        );
        counts.push((fresh, replay));
        names.push([
            (it, "T"),
            (bt, "T"),
            (cnt_orders.clone(), "O"),
            (cnt_b_orders.clone(), "O"),
        ]);
    }
    let tx_count = {
        let it = tables.idem("cnttx");
        let bt = tables.idem_shaped("b_cnttx").await?;
        let i = Subject::idem(cfg, &counter.pool, it.clone(), &cnt_orders).await?;
        let b = Subject::sqlx(&templates, &counter.pool, bt.clone(), &cnt_b_orders, false);
        names.push([
            (it, "T"),
            (bt, "T"),
            (cnt_orders.clone(), "O"),
            (cnt_b_orders.clone(), "O"),
        ]);
        (
            counter.count(&i, Phase::Tx, 16).await?,
            counter.count(&b, Phase::Tx, 16).await?,
        )
    };
    counter.pool.close().await;
    let [(f1, r1), (f16, r16)]: [_; 2] = counts
        .try_into()
        .map_err(|_| "two concurrency levels were counted")?;
    // In the order of the lines: fresh and replay counts share their tables.
    let names = [0, 1, 1, 0, 1, 1, 2].map(|i| names[i].clone()).to_vec();

    let mut lines = vec![
        Line::new("fresh c=1", 1, FRESH),
        Line::new("fresh c=16", 16, FRESH),
        Line::new("fresh c=64", 64, FRESH),
        Line::new("replay c=1", 1, REPLAY),
        Line::new("replay c=16", 16, REPLAY),
        Line::new("50% dup c=16", 16, MIX),
        Line::new("tx fresh c=16", 16, TX),
    ];
    for (at, count) in [(0, f1), (1, f16), (3, r1), (4, r16), (6, tx_count)] {
        lines[at].count = Some(count);
    }

    // The floors, and pgbench through the proxy to count its statements.
    let floor_wire = Arc::new(Wire::default());
    let floor_port = spawn_proxy(host, connect.get_port(), floor_wire.clone()).await?;
    let mut floors = Vec::new();
    if let Some(bin) = pgbench.as_deref() {
        let fresh = tables.create(FLOOR_DDL, "pgb_fresh").await?;
        let replay = tables.create(FLOOR_DDL, "pgb_replay").await?;
        let tx = tables.create(FLOOR_DDL, "pgb_tx").await?;
        let orders = tables.create(ORDERS_DDL, "pgb_orders").await?;
        let populate = format!(
            "INSERT INTO {t} SELECT '', 'bench', g::text, '\\x31' \
             FROM generate_series(1, {REPLAY_KEYS}) g",
            t = quoted(&replay)
        );
        admin.execute(populate.as_str()).await?;
        vacuum(&admin, &[&replay]).await?;
        let fill = |script: &str, table: &str| {
            script
                .replace("{table}", &quoted(table))
                .replace("{orders}", &quoted(&orders))
                .replace("{rows}", &REPLAY_KEYS.to_string())
        };
        let floor = |name, script| Floor {
            bin,
            name,
            script,
            vars: Vec::new(),
        };
        floors = vec![
            floor("fresh", fill(FRESH_SQL, &fresh)),
            floor("replay", fill(REPLAY_SQL, &replay)),
            floor("tx", fill(TX_SQL, &tx)),
        ];
        if cfg.experiments {
            // idem's SQL on idem-shaped tables; replays of keys 1..=REPLAY_KEYS.
            let fresh = tables.idem_shaped("pgi_fresh").await?;
            let replay = tables.idem_shaped("pgi_replay").await?;
            let hex: String = FINGERPRINT.iter().map(|b| format!("{b:02x}")).collect();
            let populate = format!(
                "INSERT INTO {t} (scope, name, key, state, epoch, fingerprint, lease_until, \
                 created_at, claimed_at, expires_at, outcome, outcome_version) \
                 SELECT 'p', '{NAME}', g::text, 1, 1, '\\x{hex}', now(), now(), now(), \
                 now() + interval '1 day', '\\x31', 1 FROM generate_series(1, {REPLAY_KEYS}) g",
                t = quoted(&replay)
            );
            admin.execute(populate.as_str()).await?;
            vacuum(&admin, &[&replay]).await?;
            for (name, table, replay) in
                [("idem_fresh", fresh, false), ("idem_replay", replay, true)]
            {
                floors.push(Floor {
                    bin,
                    name,
                    script: idem_sql_script(&templates.render(&table), replay),
                    vars: idem_sql_vars(),
                });
            }
        }
    }
    let mut floor_counts = Vec::new();
    for floor in floors.iter().take(3) {
        floor_counts.push(floor.count(connect, floor_port, &floor_wire)?);
    }
    let run_floor = |line: &mut Line| -> Res<()> {
        let Some(floor) = floors.get(line.script).filter(|_| line.script <= TX) else {
            return Ok(());
        };
        line.floor = Some(floor.tps(&cfg.url, line.concurrency, cfg.pgbench_secs)?);
        line.floor_count = floor_counts.get(line.script).copied();
        // The experiments' scripts follow the floors', for the fresh and replay lines.
        if let Some(idem_sql) = floors.get(3 + line.script).filter(|_| line.script < TX) {
            line.floor_idem_sql =
                Some(idem_sql.tps(&cfg.url, line.concurrency, cfg.pgbench_secs)?);
        }
        Ok(())
    };

    let idem_pool = cfg.pool().connect_with(connect.clone()).await?;
    let base_pool = cfg.pool().connect_with(connect.clone()).await?;
    // Experiments: one pool without the ping on acquire, shared by idem and the baseline.
    let quiet_pool = if cfg.experiments {
        // Its idle connections close, so pgbench's 64 clients fit beside the other pools.
        let pool = cfg
            .pool()
            .test_before_acquire(false)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(1));
        Some(pool.connect_with(connect.clone()).await?)
    } else {
        None
    };
    for line in &mut lines[..3] {
        println!("{}...", line.label);
        let c = line.concurrency;
        let fresh = Phase::Fresh;
        let it = tables.idem(&format!("fresh{c}"));
        let bt = tables.idem_shaped(&format!("b_fresh{c}")).await?;
        let mut subjects: Vec<Contender> = vec![
            (
                IDEM,
                Subject::idem(cfg, &idem_pool, it, &orders_idem).await?,
                fresh,
            ),
            (
                SQLX,
                Subject::sqlx(&templates, &base_pool, bt, &orders_base, false),
                fresh,
            ),
            (
                IDEM_OWN,
                Subject::idem_own(
                    cfg,
                    &idem_pool,
                    tables.idem(&format!("o_fresh{c}")),
                    &orders_idem,
                )
                .await?,
                fresh,
            ),
        ];
        if let Some(quiet) = &quiet_pool {
            let t = tables.idem(&format!("q_fresh{c}"));
            let i = Subject::idem(cfg, quiet, t, &orders_idem).await?;
            subjects.push((IDEM_QUIET, i, fresh));
            let t = tables.idem(&format!("r_fresh{c}"));
            let i = Subject::idem_renewing(false, &idem_pool, t, &orders_idem).await?;
            subjects.push((IDEM_NO_RENEW, i, fresh));
            let t = tables.idem_shaped(&format!("qb_fresh{c}")).await?;
            let b = Subject::sqlx(&templates, quiet, t, &orders_base, false);
            subjects.push((SQLX_QUIET, b, fresh));
            let t = tables.idem_shaped(&format!("h_fresh{c}")).await?;
            let b = Subject::sqlx(&templates, &base_pool, t, &orders_base, true);
            subjects.push((SQLX_HELD, b, fresh));
        }
        line.rounds = rounds(cfg, &subjects, c).await?;
        // Their connections closed, so pgbench's 64 clients fit under the server's limit.
        drop(subjects);
        run_floor(line)?;
    }

    println!("recording {REPLAY_KEYS} keys to replay...");
    let it = tables.idem("replay");
    let i = Subject::idem(cfg, &idem_pool, it.clone(), &orders_idem).await?;
    let bt = tables.idem_shaped("b_replay").await?;
    let b = Subject::sqlx(&templates, &base_pool, bt.clone(), &orders_base, false);
    drive(&i, Phase::Fresh, 16, Stop::Ops(REPLAY_KEYS)).await?;
    drive(&b, Phase::Fresh, 16, Stop::Ops(REPLAY_KEYS)).await?;
    vacuum(&admin, &[&it, &bt]).await?;
    let keys = Phase::Replay {
        from: 0,
        keys: REPLAY_KEYS,
    };
    // The experiments replay the same records: replays write nothing.
    let o = Subject::idem_own(cfg, &idem_pool, it.clone(), &orders_idem).await?;
    let mut subjects: Vec<Contender> = vec![(IDEM, i, keys), (SQLX, b, keys), (IDEM_OWN, o, keys)];
    if let Some(quiet) = &quiet_pool {
        let i = Subject::idem(cfg, quiet, it.clone(), &orders_idem).await?;
        subjects.push((IDEM_QUIET, i, keys));
        let i = Subject::idem_renewing(false, &idem_pool, it.clone(), &orders_idem).await?;
        subjects.push((IDEM_NO_RENEW, i, keys));
        let b = Subject::sqlx(&templates, quiet, bt.clone(), &orders_base, false);
        subjects.push((SQLX_QUIET, b, keys));
        let b = Subject::sqlx(&templates, &base_pool, bt.clone(), &orders_base, true);
        subjects.push((SQLX_HELD, b, keys));
    }
    for line in &mut lines[3..5] {
        println!("{}...", line.label);
        let runs = || -> Vec<u64> {
            let runs = subjects.iter().map(|s| s.1.runs.load(Ordering::Relaxed));
            runs.collect()
        };
        let before = runs();
        line.rounds = rounds(cfg, &subjects, line.concurrency).await?;
        if runs() != before {
            return Err("a replay ran the body".into());
        }
        run_floor(line)?;
    }

    let line = &mut lines[5];
    println!("{}...", line.label);
    let mix = Phase::Mix {
        from: 0,
        keys: REPLAY_KEYS,
    };
    let mixed: Vec<Contender> = subjects
        .iter()
        .map(|(l, s, _)| (*l, s.clone(), mix))
        .collect();
    line.rounds = rounds(cfg, &mixed, line.concurrency).await?;
    drop(mixed);

    let line = &mut lines[6];
    println!("{}...", line.label);
    let tx = Phase::Tx;
    let it = tables.idem("tx");
    let mut subjects: Vec<Contender> = vec![
        (
            IDEM,
            Subject::idem(cfg, &idem_pool, it, &orders_idem).await?,
            tx,
        ),
        (
            SQLX,
            Subject::sqlx(&templates, &base_pool, bt, &orders_base, false),
            tx,
        ),
    ];
    if cfg.experiments {
        for (label, savepoint) in [(SQLX_TX, true), (SQLX_TX_NO_SAVEPOINT, false)] {
            let table = tables.idem_shaped(&format!("tx_{savepoint}")).await?;
            let orders = tables
                .create(ORDERS_DDL, &format!("tx_orders_{savepoint}"))
                .await?;
            let sql = templates.render(&table);
            let side = Side::SqlxTx { sql, savepoint };
            subjects.push((label, Subject::new(side, &base_pool, table, &orders), tx));
        }
    }
    line.rounds = rounds(cfg, &subjects, 16).await?;
    run_floor(line)?;
    drop(subjects);
    idem_pool.close().await;
    base_pool.close().await;
    if let Some(quiet) = quiet_pool {
        quiet.close().await;
    }

    Report {
        cfg,
        server,
        lines,
        names,
        templates,
    }
    .print();
    Ok(())
}
