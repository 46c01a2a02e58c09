//! The production store's dialect: one PostgreSQL table, leases by the database's clock.
//!
//! Times are `clock_timestamp()`, the wall clock at the moment of evaluation; `now()`
//! would be the start of the transaction, which in a caller's long transaction is old.
//! Claims and records run on connections idem holds itself when it opened the database
//! (no ping per statement); waiters in other processes are woken through
//! `LISTEN`/`NOTIFY`. The claim is one statement that reads its snapshot first, so a
//! replay neither locks nor writes; under READ COMMITTED it may miss a row committed
//! after it began and is then issued again (`CLAIM_ATTEMPTS`). The schema, the claim,
//! wake-ups, group commit, purge and the errors are described for users in
//! [`guide::postgres`](crate::guide::postgres).
//!
//! # Connections
//!
//! Opened by `Idem::postgres` or `IdemBuilder::postgres`, one store (and every clone of
//! its `Idem`) holds at most 21 connections to the server by default:
//!
//! - `max_connections` (default 16) for claims, records, releases, lease renewals and
//!   replay reads, opened on demand, kept while idle, closed after a failure on the
//!   wire;
//! - a sqlx pool of up to 4 ([`ADMIN_CONNECTIONS`]) for migrations, the checks on open,
//!   announcing waiters, and the operations queries (`stats`, `list`, `purge`, ...);
//! - 1 listening for wake-ups (`LISTEN idem_wake`), held for the store's life.
//!
//! `IdemBuilder::max_connections` sets the first number only: the whole is
//! `max_connections + 5`. On an application's pool (`Idem::from_pool`) idem takes its
//! connections from that pool, transactional mode uses the caller's own, and the
//! listener adds one of its own. Opening needs one free slot: a server with none left
//! refuses the open at once with its reason (SQLSTATE 53300) and these numbers.
//!
//! # A read-only server
//!
//! A hot standby, a primary being demoted in a failover, or
//! `default_transaction_read_only` refuses idem's writes with SQLSTATE 25006 ("cannot
//! execute … in a read-only transaction", "… during recovery"). That is a retryable
//! store error, never an unreachable one: the body does not run, and `fail_open` does
//! not run it unprotected either (the server answered and holds the records, a running
//! call's claim among them); a record is retried while its lease holds; and the
//! connection is closed, so the next one may reach the primary that replaced it.
//! Opening on a read-only server fails the same way, as the open writes its
//! bookkeeping.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::Executor;
use sqlx::postgres::{
    PgArguments, PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow,
};

use super::OperationId;
use super::engine::{
    Arg, Dialect, Gathered, On, Row, SqlDb, SqlStore, Stmt, bind, decode_row, migrate, open_error,
    statements,
};
use super::group::Gather;
use super::sql_common::{self, Server, SqlOptions, TableName, first_connection, redact_url};
use crate::error::{IdemError, StoreError};
use crate::store::WakeHub;

/// The operations table as idem creates it on PostgreSQL, with the default table name.
///
/// For teams that run their own DDL (`migrate(false)`); the statements are idempotent.
pub const POSTGRES_SCHEMA_SQL: &str = concat!(
    include_str!("../../migrations/postgres/0001_create_operations.sql"),
    "\n",
    include_str!("../../migrations/postgres/0002_epochs_and_key_mode.sql"),
    "\n",
    include_str!("../../migrations/postgres/0003_steps.sql"),
    "\n",
    include_str!("../../migrations/postgres/0004_released_expiry.sql"),
);

/// The migrations, in order: (version, DDL in the default table name). Each is
/// idempotent, so a table created by hand from [`POSTGRES_SCHEMA_SQL`] can be adopted.
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../migrations/postgres/0001_create_operations.sql"),
    ),
    (
        2,
        include_str!("../../migrations/postgres/0002_epochs_and_key_mode.sql"),
    ),
    (3, include_str!("../../migrations/postgres/0003_steps.sql")),
    (
        4,
        include_str!("../../migrations/postgres/0004_released_expiry.sql"),
    ),
];

/// The advisory lock that serializes idem's migrations across processes ("idemmigr").
const MIGRATION_LOCK: i64 = 0x6964_656d_6d69_6772;

/// The channel on which record/release/mark_unknown/resolve announce that an operation
/// moved on, when someone waits on it. The payload is the JSON of its [`OperationId`].
const WAKE_CHANNEL: &str = "idem_wake";

/// Connections `Idem::postgres` holds for claims and records, unless the builder says
/// otherwise.
const DEFAULT_MAX_CONNECTIONS: u32 = 16;

/// Connections of the sqlx pool beside idem's own, for what is not on the hot path.
const ADMIN_CONNECTIONS: u32 = 4;

/// SQLSTATE `too_many_connections`: no slot left on the server, for the database or
/// for the role.
const TOO_MANY_CONNECTIONS: &str = "53300";

/// The connections [`open`] holds at most, with `hot` for claims and records, in words.
fn footprint(hot: u32) -> String {
    format!(
        "idem holds up to {} connections to this server ({hot} for claims and records, set \
         by `max_connections`; {ADMIN_CONNECTIONS} for migrations and operations queries; 1 \
         listening for wake-ups)",
        hot + ADMIN_CONNECTIONS + 1
    )
}

const LOCK_MIGRATIONS: &str = "SELECT pg_advisory_xact_lock($1)";

/// Aborts the wake listener when the store goes away.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Connections idem holds for its hot statements, outside sqlx's pool.
///
/// sqlx's pool pings every connection when it is returned (to catch one a cancelled
/// query left mid-protocol), one more round trip per statement than the statement
/// itself. Here a connection goes back only when its statement finished; one whose
/// statement was cancelled or failed on the wire is dropped (closed) instead, which
/// gives the same safety without the round trip.
#[derive(Debug)]
struct Conns {
    options: PgConnectOptions,
    permits: tokio::sync::Semaphore,
    idle: Mutex<Vec<(PgConnection, std::time::Instant)>>,
}

impl Conns {
    fn new(options: PgConnectOptions, max: u32) -> Conns {
        Conns {
            options,
            permits: tokio::sync::Semaphore::new(max.max(1) as usize),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `query` on an idle connection (or a new one) and returns the connection
    /// only if the statement completed.
    async fn fetch_all(&self, query: Query<'_>) -> Result<Vec<PgRow>, sqlx::Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let mut conn = self.take().await?;
        let out = query.fetch_all(&mut conn).await;
        // A statement error leaves the connection ready for the next statement; an I/O
        // or protocol error, or the server ending the session (SQLSTATE classes 08 and
        // 57, as in a shutdown or `pg_terminate_backend`), does not. Nor does a
        // read-only refusal (25006): the server is a standby or was demoted, and a new
        // connection may reach the primary that replaced it.
        let reusable = match &out {
            Ok(_) => true,
            Err(sqlx::Error::Database(e)) => !e.code().is_some_and(|c| {
                c.starts_with("08") || c.starts_with("57") || c == READ_ONLY_TRANSACTION
            }),
            Err(_) => false,
        };
        if reusable {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.push((conn, std::time::Instant::now()));
        }
        out
    }

    async fn take(&self) -> Result<PgConnection, sqlx::Error> {
        loop {
            let next = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let Some((mut conn, since)) = next else {
                return sqlx::Connection::connect_with(&self.options).await;
            };
            if since.elapsed() <= sql_common::IDLE_BEFORE_PING
                || sqlx::Connection::ping(&mut conn).await.is_ok()
            {
                return Ok(conn);
            }
        }
    }
}

/// The PostgreSQL dialect: a pool, idem's own connections when it opened the database,
/// and (once wakers are attached) a background `LISTEN` task that stops with the store.
#[derive(Debug)]
pub struct Pg {
    pub(crate) pool: PgPool,
    /// The claim's and the record's connections, when idem opened the database itself.
    owned: Option<Arc<Conns>>,
    /// Group commit of claims and records (none on the migrations' dialect).
    group: Option<Arc<PgGroup>>,
    listener: Mutex<Option<AbortOnDrop>>,
}

/// The PostgreSQL store.
pub(crate) type PgStore = SqlStore<Pg>;

impl SqlDb for sqlx::Postgres {
    type Dialect = Pg;
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, PgArguments>;

#[async_trait::async_trait]
impl Dialect for Pg {
    type Db = sqlx::Postgres;
    type Conn = PgConnection;
    const NOW: &'static str = "clock_timestamp()";
    const NEXT_EPOCH: &'static str = "nextval('{epoch_seq}')";
    const SCHEMA: &'static str = "POSTGRES_SCHEMA_SQL";
    const CLAIM_ATTEMPTS: usize = 5;
    // The claim answers a replay in its one statement too, but a plain primary-key read
    // is lighter; fresh calls skip it.
    const PEEK_WHILE_REPLAYING: bool = true;
    const PEEK_ON_HOT: bool = true;

    statements!(
        "postgres",
        "announce_wait",
        "wake",
        "peek",
        "claim_batch",
        "claim_fresh_batch",
        "claim_conflict",
        "record_batch",
        "purge_locked",
        "claim_fresh"
    );

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn map_err(e: sqlx::Error) -> StoreError {
        sql_common::map_sqlx(e, retryable_code, unreachable_code)
    }

    fn is_conflict(e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(e) if matches!(e.code().as_deref(), Some("40001" | "40P01")))
    }

    fn is_lock_wait(e: &sqlx::Error) -> bool {
        // 55P03: lock_timeout; 40P01: a deadlock, where an operator set deadlock_timeout
        // below the purge's wait limit.
        matches!(e, sqlx::Error::Database(e) if matches!(e.code().as_deref(), Some("55P03" | "40P01")))
    }

    async fn fetch(
        &self,
        on: On<'_, PgConnection>,
        stmt: &Stmt,
        args: Vec<Arg<'_>>,
    ) -> Result<Vec<Row>, sqlx::Error> {
        let query = bind(sqlx::query(&stmt.sql), args);
        let rows = match on {
            On::Hot => hot(&self.pool, self.owned.as_deref(), query).await?,
            On::Pool => query.fetch_all(&self.pool).await?,
            On::Conn(conn) => query.fetch_all(conn).await?,
        };
        rows.iter().map(decode_row).collect()
    }

    /// Only while every connection is busy: a statement would wait for one anyway, and
    /// joining the next batch costs less than that wait. Below that, each statement
    /// runs at once on a connection of its own, which the server runs in parallel
    /// (`cargo bench -p idem-tests --bench pg_pools`: at 16 callers on 16 connections
    /// gathering runs 0.6–0.9 of single statements; at 64 callers, 1.7–2.0 of them).
    fn gathers(&self) -> bool {
        self.group.is_some() && self.saturated()
    }

    async fn gathered(&self, op: Gathered) -> Option<Result<Vec<Row>, sqlx::Error>> {
        let group = self.group.as_ref()?;
        let gather = match &op {
            Gathered::Fresh { .. } => &group.fresh,
            Gathered::Claim { to_unknown, .. } => &group.claims[usize::from(*to_unknown)],
            Gathered::Record { .. } => &group.records,
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let write = |batch| write_batch(group.clone(), batch);
        let rows = gather.submit(Waiting { op, reply }, answer, write).await;
        Some(rows.unwrap_or_else(|| {
            Err(sqlx::Error::Protocol(
                "a group-commit batch ended without answering (its write panicked)".into(),
            ))
        }))
    }

    /// An advisory lock: processes opening at once migrate one after another (even
    /// `CREATE ... IF NOT EXISTS` can fail on a concurrent create).
    async fn begin_migrations(
        &self,
        table: &TableName,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(LOCK_MIGRATIONS)
            .bind(MIGRATION_LOCK)
            .execute(&mut *tx)
            .await?;
        // Every open runs `CREATE ... IF NOT EXISTS` on what exists already, and the
        // server answers each with a NOTICE that sqlx logs: quiet them for this
        // transaction only, warnings and errors still reported.
        tx.execute("SET LOCAL client_min_messages = warning")
            .await?;
        if let Some(schema) = table.schema() {
            let create = format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"");
            tx.execute(create.as_str()).await?;
        }
        Ok(tx)
    }

    async fn run_script(&self, conn: &mut PgConnection, sql: &str) -> Result<(), sqlx::Error> {
        // No bind parameters: the simple protocol, which runs several statements.
        conn.execute(sql).await.map(drop)
    }

    async fn execute(&self, stmt: &Stmt, args: Vec<Arg<'_>>) -> Result<u64, sqlx::Error> {
        let done = bind(sqlx::query(&stmt.sql), args)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn from_pool(pool: PgPool, opts: &SqlOptions) -> Result<PgStore, IdemError> {
        from_pool(pool, opts).await
    }

    fn attach_wakers(&self, hub: Arc<WakeHub>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "idem: no tokio runtime when attaching PostgreSQL wakers; waiters on other \
                 processes' operations will poll instead of being woken"
            );
            return;
        };
        let options = (*self.pool.connect_options()).clone();
        let task = AbortOnDrop(runtime.spawn(listen(options, hub)));
        let mut listener = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        // A second attach replaces the first (dropping it aborts the old task).
        *listener = Some(task);
    }
}

impl Pg {
    /// Whether the claims' and records' connections are all in use.
    fn saturated(&self) -> bool {
        match &self.owned {
            Some(conns) => conns.permits.available_permits() == 0,
            None => {
                self.pool.num_idle() == 0
                    && self.pool.size() >= self.pool.options().get_max_connections()
            }
        }
    }
}

/// Runs a claim's or a record's statement on idem's own connections, or on the pool
/// when it has none.
async fn hot(
    pool: &PgPool,
    owned: Option<&Conns>,
    query: Query<'_>,
) -> Result<Vec<PgRow>, sqlx::Error> {
    match owned {
        Some(conns) => conns.fetch_all(query).await,
        None => query.fetch_all(pool).await,
    }
}

/// Batches of one kind in flight at once. One: while it waits for its commit, every
/// caller arriving joins the next batch. Two measure the same at 64 callers, within
/// the noise; four and more run below them (smaller batches, each paying its own
/// commit).
const GROUP_WRITERS: usize = 1;

/// Group commit: concurrent claims (and concurrent records) are gathered into one
/// statement over arrays, one round trip and one commit for the lot, each row decided
/// alone and answered to its caller. A claim first joins the plain inserts of new keys
/// (`claim_fresh_batch.sql`), as a lone claim first tries `claim_fresh.sql`; one whose
/// key exists then joins the full claims (`claim_batch.sql`), which gather by takeover
/// policy, bound once per statement. Records: `record_batch.sql`.
#[derive(Debug)]
struct PgGroup {
    pool: PgPool,
    owned: Option<Arc<Conns>>,
    claim_fresh: Stmt,
    claim: Stmt,
    record: Stmt,
    claim_fresh_batch: Stmt,
    claim_batch: Stmt,
    record_batch: Stmt,
    /// Claims whose takeover reruns (`[0]`) or marks UNKNOWN (`[1]`).
    claims: [Gather<Waiting>; 2],
    /// Plain inserts of keys with no record yet.
    fresh: Gather<Waiting>,
    records: Gather<Waiting>,
}

/// A claim or record waiting for its batch, and where its rows go.
#[derive(Debug)]
struct Waiting {
    op: Gathered,
    reply: Reply,
}

type Reply = tokio::sync::oneshot::Sender<Result<Vec<Row>, sqlx::Error>>;

/// `statement`'s output, or `None` once every caller it answers has given up (its store
/// timeout passed, or it went away at its deadline): the statement's future is then
/// dropped, which closes its connection, so a batch on a connection gone silent does
/// not hold it past the callers' timeouts.
async fn while_awaited<T>(
    replies: &mut [&mut Reply],
    statement: impl std::future::Future<Output = T>,
) -> Option<T> {
    let gone = async {
        for reply in replies.iter_mut() {
            reply.closed().await;
        }
    };
    tokio::select! {
        biased;
        () = gone => None,
        out = statement => Some(out),
    }
}

/// Writes a gathered batch, as many statements as it has repeats of one key (a statement
/// may change a row once): the first of each key in the first, and so on. A statement of
/// one is the plain one, which is lighter.
async fn write_batch(group: Arc<PgGroup>, batch: Vec<Waiting>) {
    let mut rest = batch;
    while !rest.is_empty() {
        let mut seen = std::collections::HashSet::new();
        let (mut now, later): (Vec<_>, Vec<_>) = rest
            .into_iter()
            .partition(|w| seen.insert(w.op.id().clone()));
        rest = later;
        if now.len() == 1 {
            alone(&group, now).await;
            continue;
        }
        let stmt = match now[0].op {
            Gathered::Fresh { .. } => &group.claim_fresh_batch,
            Gathered::Claim { .. } => &group.claim_batch,
            Gathered::Record { .. } => &group.record_batch,
        };
        let done = {
            let (ops, mut replies): (Vec<&Gathered>, Vec<&mut Reply>) =
                now.iter_mut().map(|w| (&w.op, &mut w.reply)).unzip();
            let calls: Vec<_> = ops.iter().map(|op| op.args()).collect();
            match bind_batch(stmt, &calls) {
                Ok(query) => {
                    let write = hot(&group.pool, group.owned.as_deref(), query);
                    while_awaited(&mut replies, write).await
                }
                Err(e) => Some(Err(e)),
            }
        };
        let Some(done) = done else {
            tracing::debug!("every caller of a batch gave up on it; its statement was dropped");
            continue;
        };
        match done {
            Ok(rows) => answer(now, &rows),
            Err(e) if refused(&e) => {
                tracing::debug!(error = %e, "group commit refused; issuing each alone");
                alone(&group, now).await;
            }
            Err(e) => fail_all(now, &e),
        }
    }
}

/// Whether the server refused a batch's statement on a connection that is still up: then
/// none of it took effect, and each call is issued alone, so that a refusal is its own
/// caller's. A connection-level failure (I/O, or SQLSTATE classes 08 and 57P: the
/// server went away, is going, or ended the session) is not a refusal: the server may
/// be down, and issuing each call again would meet it once per caller.
fn refused(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if !db.code().is_some_and(|c| unreachable_code(&c)))
}

/// Answers every caller of a failed batch with the same error, classified as its own
/// statement's would be (a connection-level failure stays unreachable and retryable).
fn fail_all(batch: Vec<Waiting>, e: &sqlx::Error) {
    for w in batch {
        let _ = w.reply.send(Err(copy_error(e)));
    }
}

/// Issues each one's own statement (`claim.sql`, `record.sql`), one after another.
async fn alone(group: &PgGroup, each: Vec<Waiting>) {
    for mut w in each {
        let stmt = match w.op {
            Gathered::Fresh { .. } => &group.claim_fresh,
            Gathered::Claim { .. } => &group.claim,
            Gathered::Record { .. } => &group.record,
        };
        let rows = match stmt.args(&w.op.args()) {
            Ok(args) => {
                let write = hot(
                    &group.pool,
                    group.owned.as_deref(),
                    bind(sqlx::query(&stmt.sql), args),
                );
                match while_awaited(&mut [&mut w.reply], write).await {
                    Some(rows) => rows.and_then(|rows| rows.iter().map(decode_row).collect()),
                    None => continue,
                }
            }
            Err(e) => Err(sqlx::Error::Protocol(e.to_string())),
        };
        let _ = w.reply.send(rows);
    }
}

/// Hands each caller the rows of its `ord` (1-based position in the batch).
fn answer(batch: Vec<Waiting>, rows: &[PgRow]) {
    let mut mine: Vec<Vec<Row>> = batch.iter().map(|_| Vec::new()).collect();
    for row in rows {
        let decoded =
            sqlx::Row::try_get::<i64, _>(row, "ord").and_then(|ord| Ok((ord, decode_row(row)?)));
        match decoded {
            Ok((ord, row)) => {
                if let Some(rows) = usize::try_from(ord - 1).ok().and_then(|i| mine.get_mut(i)) {
                    rows.push(row);
                }
            }
            Err(e) => {
                fail_all(batch, &e);
                return;
            }
        }
    }
    for (w, rows) in batch.into_iter().zip(mine) {
        let _ = w.reply.send(Ok(rows));
    }
}

/// Binds a batch statement's parameters from each call's own (`calls`, as its single
/// statement takes them): a parameter named `<name>s` takes the array of every call's
/// `<name>`; any other, the value the calls share (claims gather by takeover policy).
fn bind_batch<'q>(
    stmt: &'q Stmt,
    calls: &'q [Vec<(&'static str, Arg<'q>)>],
) -> Result<Query<'q>, sqlx::Error> {
    fn value<'q>(call: &[(&'static str, Arg<'q>)], name: &str) -> Result<Arg<'q>, sqlx::Error> {
        call.iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, a)| a)
            .ok_or_else(|| sqlx::Error::Protocol(format!("a batch call has no `{name}`")))
    }
    fn array<'q, T>(
        column: &[Arg<'q>],
        pick: fn(Arg<'q>) -> Option<T>,
    ) -> Result<Vec<T>, sqlx::Error> {
        column
            .iter()
            .map(|&a| {
                pick(a).ok_or_else(|| {
                    sqlx::Error::Protocol(format!("mixed types in a batch column: {a:?}"))
                })
            })
            .collect()
    }
    let mut query = sqlx::query(&stmt.sql);
    for name in stmt.param_names() {
        let first = calls.first().map_or(&[][..], Vec::as_slice);
        let Some(each) = name
            .strip_suffix('s')
            .filter(|one| first.iter().any(|(n, _)| n == one))
        else {
            query = bind(query, vec![value(first, name)?]);
            continue;
        };
        let column = calls
            .iter()
            .map(|call| value(call, each))
            .collect::<Result<Vec<_>, _>>()?;
        query = match column.first() {
            Some(Arg::Text(_)) => query.bind(array(&column, |a| match a {
                Arg::Text(t) => Some(t),
                _ => None,
            })?),
            Some(Arg::Bytes(_)) => query.bind(array(&column, |a| match a {
                Arg::Bytes(b) => Some(b),
                _ => None,
            })?),
            Some(Arg::Int(_)) => query.bind(array(&column, |a| match a {
                Arg::Int(i) => Some(i),
                _ => None,
            })?),
            Some(Arg::Bool(_)) => query.bind(array(&column, |a| match a {
                Arg::Bool(b) => Some(b),
                _ => None,
            })?),
            other => {
                return Err(sqlx::Error::Protocol(format!(
                    "no array for the batch parameter `{name}` ({other:?})"
                )));
            }
        };
    }
    Ok(query)
}

/// The same error for each caller of a failed batch (`sqlx::Error` is not `Clone`),
/// keeping what decides whether it is retryable and unreachable: the kind, and a
/// database error's SQLSTATE.
fn copy_error(e: &sqlx::Error) -> sqlx::Error {
    match e {
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        sqlx::Error::Tls(tls) => sqlx::Error::Tls(tls.to_string().into()),
        sqlx::Error::Database(db) => sqlx::Error::Database(Box::new(CopiedDbError::of(&**db))),
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
        sqlx::Error::WorkerCrashed => sqlx::Error::WorkerCrashed,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// A database error as another caller of the same batch sees it: its message, SQLSTATE
/// and kind.
#[derive(Debug)]
struct CopiedDbError {
    message: String,
    code: Option<String>,
    kind: sqlx::error::ErrorKind,
}

impl CopiedDbError {
    fn of(e: &dyn sqlx::error::DatabaseError) -> CopiedDbError {
        CopiedDbError {
            message: e.message().to_owned(),
            code: e.code().map(|c| c.into_owned()),
            kind: copy_kind(&e.kind()),
        }
    }
}

/// `ErrorKind` is not `Clone`.
fn copy_kind(kind: &sqlx::error::ErrorKind) -> sqlx::error::ErrorKind {
    use sqlx::error::ErrorKind;
    match kind {
        ErrorKind::UniqueViolation => ErrorKind::UniqueViolation,
        ErrorKind::ForeignKeyViolation => ErrorKind::ForeignKeyViolation,
        ErrorKind::NotNullViolation => ErrorKind::NotNullViolation,
        ErrorKind::CheckViolation => ErrorKind::CheckViolation,
        _ => ErrorKind::Other,
    }
}

impl std::fmt::Display for CopiedDbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CopiedDbError {}

impl sqlx::error::DatabaseError for CopiedDbError {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.code.as_deref().map(std::borrow::Cow::Borrowed)
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        copy_kind(&self.kind)
    }
}

/// Connects to `url` and opens the idem table there, creating it unless `opts.migrate`
/// is false.
pub(crate) async fn open(url: &str, opts: &SqlOptions) -> Result<PgStore, IdemError> {
    let table = TableName::parse(&opts.table, true)?;
    let shown = redact_url(url);
    let connect = PgConnectOptions::from_str(url).map_err(|e| IdemError::Config {
        message: format!(
            "invalid PostgreSQL URL `{shown}`: {e}; expected `postgres://user:password@host:port/database`"
        ),
    })?;
    let connect = match &opts.root_cert {
        Some(pem) => connect.ssl_root_cert_from_pem(pem.clone()),
        None => connect,
    };
    let hot = opts
        .max_connections
        .unwrap_or(DEFAULT_MAX_CONNECTIONS)
        .max(1);
    let server = Server {
        db: "PostgreSQL",
        shown: &shown,
        at: match connect.get_socket() {
            Some(socket) => socket.display().to_string(),
            None => format!("{}:{}", connect.get_host(), connect.get_port()),
        },
        map_err,
        is_full: |e| matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(TOO_MANY_CONNECTIONS)),
        footprint: footprint(hot),
        tls_params: ("sslmode", "sslrootcert"),
    };
    let first = first_connection(&server, &connect).await?;
    let _ = sqlx::Connection::close(first).await;
    // The claim and the record run on idem's own connections (`Conns`); this pool
    // serves migrations, renewals and the operations queries.
    let pool =
        sql_common::pinged_when_idle(PgPoolOptions::new().max_connections(ADMIN_CONNECTIONS))
            .connect_lazy_with(connect.clone());
    // The open's own statements run one at a time on a pool of one. A bigger pool opens
    // a second connection while the first is still on its way back to it, and on a
    // server with one slot left that second one is refused, retried and refused until
    // the pool's acquire timeout.
    let opening = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(connect);
    let owned = Arc::new(Conns::new((*pool.connect_options()).clone(), hot));
    prepare(pool, Some(opening), Some(owned), table, opts).await
}

/// Uses an application's pool; creates the idem table unless `opts.migrate` is false.
pub(crate) async fn from_pool(pool: PgPool, opts: &SqlOptions) -> Result<PgStore, IdemError> {
    let table = TableName::parse(&opts.table, true)?;
    prepare(pool, None, None, table, opts).await
}

/// Migrates and checks the table on `opening` (closed afterwards) or else on `pool`,
/// then returns the store on `pool`.
async fn prepare(
    pool: PgPool,
    opening: Option<PgPool>,
    owned: Option<Arc<Conns>>,
    table: TableName,
    opts: &SqlOptions,
) -> Result<PgStore, IdemError> {
    let on_open = opening.clone().unwrap_or_else(|| pool.clone());
    if opts.migrate {
        let migrator = Pg {
            pool: on_open.clone(),
            owned: None,
            group: None,
            listener: Mutex::new(None),
        };
        migrate(&migrator, &table, MIGRATIONS).await.map_err(|e| {
            open_error::<Pg>(
                e,
                format!(
                    "cannot create the idem table `{table}`; grant CREATE on its schema, or \
                     create it yourself with `POSTGRES_SCHEMA_SQL` and disable migrate"
                ),
            )
        })?;
    }
    let group = PgGroup {
        pool: pool.clone(),
        owned: owned.clone(),
        claim_fresh: Stmt::render::<Pg>(Pg::sql("claim_fresh"), &table),
        claim: Stmt::render::<Pg>(Pg::sql("claim"), &table),
        claim_fresh_batch: Stmt::render::<Pg>(Pg::sql("claim_fresh_batch"), &table),
        record: Stmt::render::<Pg>(Pg::sql("record"), &table),
        claim_batch: Stmt::render::<Pg>(Pg::sql("claim_batch"), &table),
        record_batch: Stmt::render::<Pg>(Pg::sql("record_batch"), &table),
        claims: [Gather::new(GROUP_WRITERS), Gather::new(GROUP_WRITERS)],
        records: Gather::new(GROUP_WRITERS),
        fresh: Gather::new(GROUP_WRITERS),
    };
    let dialect = Pg {
        pool: on_open,
        owned,
        group: opts.group_commit.then(|| Arc::new(group)),
        listener: Mutex::new(None),
    };
    let prepared = SqlStore::prepare(dialect, &table, &opts.key_mode).await;
    if let Some(opening) = opening {
        opening.close().await;
    }
    let mut store = prepared?;
    store.dialect.pool = pool;
    Ok(store)
}

/// `read_only_sql_transaction`: "cannot execute … in a read-only transaction" (a
/// standby, a primary being demoted in a failover, `default_transaction_read_only`) and
/// "cannot execute … during recovery".
const READ_ONLY_TRANSACTION: &str = "25006";

/// SQLSTATEs a retry can clear: serialization failure, deadlock, lock timeout, statement
/// timeout, server shutting down or starting, too many connections, the connection
/// exception class, and a read-only server (a failover in progress: the retry may reach
/// the new primary).
fn retryable_code(code: &str) -> bool {
    matches!(
        code,
        "40001"
            | "40P01"
            | "55P03"
            | "57014"
            | "57P01"
            | "57P02"
            | "57P03"
            | TOO_MANY_CONNECTIONS
            | READ_ONLY_TRANSACTION
    ) || code.starts_with("08")
}

/// SQLSTATEs that mean the server cannot be reached: the connection exception class and
/// a server shutting down, crashed or starting. Not contention, refusals, conflicts, or
/// a read-only server: that one answered and holds the records (a running call's claim
/// among them), so `fail_open` running the body unprotected could duplicate a call idem
/// knows of, where a retry after the failover succeeds.
fn unreachable_code(code: &str) -> bool {
    code.starts_with("08") || code.starts_with("57P")
}

/// Maps a driver error to a [`StoreError`], retryable when a retry can clear it.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    Pg::map_err(e)
}

/// The wake listener: one dedicated connection (its own pool of one, so it never takes a
/// connection from the store's pool) that `LISTEN`s on [`WAKE_CHANNEL`] and wakes this
/// process's waiters. `PgListener` reconnects and re-subscribes by itself; notifications
/// sent while it was down are lost, and those waiters fall back to polling the lease.
async fn listen(options: PgConnectOptions, hub: Arc<WakeHub>) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(100);
    const MAX_BACKOFF: Duration = Duration::from_secs(30);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options);
    let mut backoff = FIRST_BACKOFF;
    let mut listener = loop {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(WAKE_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match connected.await {
            Ok(listener) => break listener,
            Err(e) => {
                tracing::warn!(error = %e, "idem: cannot LISTEN for wake-ups; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    };
    backoff = FIRST_BACKOFF;
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                backoff = FIRST_BACKOFF;
                match serde_json::from_str::<OperationId>(notification.payload()) {
                    Ok(id) => hub.wake(&id),
                    Err(e) => tracing::debug!(error = %e, "idem: ignoring a malformed wake-up"),
                }
            }
            Ok(None) => {
                tracing::debug!("idem: wake listener reconnected; wake-ups meanwhile were lost");
            }
            Err(e) => {
                tracing::warn!(error = %e, "idem: wake listener failed; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::engine::Val;
    use crate::store::test_support::*;
    use crate::store::{Claim, Fence, OperationId, Store};
    use sqlx::Row as _;

    fn url() -> String {
        std::env::var("IDEM_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    /// A store on its own table, dropped (with its bookkeeping) by [`TestDb::cleanup`].
    struct TestDb {
        store: PgStore,
        admin: PgPool,
        table: String,
    }

    /// Whether anything listens at the URL's host and port, asked once with a short
    /// timeout, so a machine without PostgreSQL skips at once rather than waiting out a
    /// pool's connect timeout in every test.
    fn reachable(url: &str) -> bool {
        static UP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *UP.get_or_init(|| {
            use std::net::ToSocketAddrs;
            let Ok(opts) = PgConnectOptions::from_str(url) else {
                return false;
            };
            (opts.get_host(), opts.get_port())
                .to_socket_addrs()
                .is_ok_and(|mut addrs| {
                    addrs.any(|a| {
                        std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok()
                    })
                })
        })
    }

    impl TestDb {
        /// `None` (after one line on stdout) when PostgreSQL is not reachable, unless
        /// `IDEM_REQUIRE_DB=1`.
        async fn new(test: &str) -> Option<TestDb> {
            Self::with_table(&format!("idem_t_{test}_{}", std::process::id())).await
        }

        async fn with_table(table: &str) -> Option<TestDb> {
            let url = url();
            let required = std::env::var("IDEM_REQUIRE_DB").as_deref() == Ok("1");
            let skip = || {
                use std::io::Write;
                // Straight to stderr: the harness captures `println!` of passing tests.
                let _ = writeln!(
                    std::io::stderr(),
                    "skipping: PostgreSQL not reachable at {} (set IDEM_POSTGRES_URL)",
                    redact_url(&url)
                );
            };
            if !required && !reachable(&url) {
                skip();
                return None;
            }
            let admin = match PgPoolOptions::new().max_connections(2).connect(&url).await {
                Ok(pool) => pool,
                Err(_) if !required => {
                    skip();
                    return None;
                }
                Err(e) => panic!("PostgreSQL not reachable at {url} and IDEM_REQUIRE_DB=1: {e}"),
            };
            drop_table(&admin, table).await;
            let opts = SqlOptions {
                table: table.to_owned(),
                migrate: true,
                ..SqlOptions::default()
            };
            let store = open(&url, &opts).await.expect("open PostgreSQL store");
            Some(TestDb {
                store,
                admin,
                table: table.to_owned(),
            })
        }

        async fn cleanup(self) {
            let TestDb {
                store,
                admin,
                table,
            } = self;
            store.dialect.pool.close().await;
            drop_table(&admin, &table).await;
        }
    }

    async fn drop_table(admin: &PgPool, table: &str) {
        let name = TableName::parse(table, true).unwrap();
        let drop = format!(
            "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP SEQUENCE IF EXISTS {}; \
             DROP TABLE IF EXISTS {}",
            name.qualified(),
            name.companion("_meta"),
            name.companion("_epoch_seq"),
            name.companion("_steps")
        );
        admin.execute(drop.as_str()).await.expect("drop test table");
        let forget = format!(
            "DO $$ BEGIN IF to_regclass('{bk}') IS NOT NULL THEN \
             DELETE FROM {bk} WHERE table_name = '{bare}'; END IF; END $$",
            bk = name.sibling("idem_schema_migrations"),
            bare = name.bare(),
        );
        admin
            .execute(forget.as_str())
            .await
            .expect("forget test bookkeeping");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_claims_on_a_fresh_key_acquire_once() {
        let Some(db) = TestDb::new("concurrent").await else {
            return;
        };
        let store = Arc::new(db.store);
        for round in 0..3 {
            let id = Arc::new(op(&format!("hot-{round}")));
            let barrier = Arc::new(tokio::sync::Barrier::new(50));
            let tasks: Vec<_> = (0..50)
                .map(|_| {
                    let (store, id, barrier) = (store.clone(), id.clone(), barrier.clone());
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.claim(&req(&id, FP, LEASE)).await
                    })
                })
                .collect();
            let mut acquired = 0;
            for task in tasks {
                match task.await.unwrap().expect("claim under contention") {
                    Claim::Acquired {
                        takeover: false, ..
                    } => acquired += 1,
                    Claim::InFlight { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(acquired, 1, "round {round}");
        }
        let store = Arc::into_inner(store).expect("tasks done");
        TestDb { store, ..db }.cleanup().await;
    }

    #[tokio::test]
    async fn schema_qualified_table_and_reopen() {
        let schema = format!("idem_s_{}", std::process::id());
        let table = format!("{schema}.ops");
        let Some(db) = TestDb::with_table(&table).await else {
            return;
        };
        let id = op("q-1");
        assert!(matches!(
            claim(&db.store, &id, FP, LEASE).await,
            Claim::Acquired {
                takeover: false,
                ..
            }
        ));
        // Opening again (as another process would) finds the table migrated and keeps it.
        let opts = SqlOptions {
            table: table.clone(),
            migrate: true,
            ..SqlOptions::default()
        };
        let again = open(&url(), &opts).await.unwrap();
        assert!(matches!(
            claim(&again, &id, FP, LEASE).await,
            Claim::InFlight { .. }
        ));
        let no_ddl = SqlOptions {
            table: table.clone(),
            migrate: false,
            ..SqlOptions::default()
        };
        assert!(from_pool(db.admin.clone(), &no_ddl).await.is_ok());
        let admin = db.admin.clone();
        db.cleanup().await;
        let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        admin.execute(drop.as_str()).await.unwrap();
    }

    #[tokio::test]
    async fn concurrent_opens_migrate_once() {
        let Some(db) = TestDb::new("opens").await else {
            return;
        };
        db.cleanup().await;
        let table = format!("idem_t_opens_{}", std::process::id());
        let opts = SqlOptions {
            table: table.clone(),
            migrate: true,
            ..SqlOptions::default()
        };
        let url = url();
        let opens: Vec<_> = (0..6)
            .map(|_| {
                let (url, opts) = (url.clone(), opts.clone());
                tokio::spawn(async move { open(&url, &opts).await })
            })
            .collect();
        let mut stores = Vec::new();
        for handle in opens {
            stores.push(handle.await.unwrap().expect("concurrent open"));
        }
        let admin = stores[0].dialect.pool.clone();
        let versions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_schema_migrations WHERE table_name = $1")
                .bind(&table)
                .fetch_one(&admin)
                .await
                .unwrap();
        assert_eq!(versions, i64::try_from(MIGRATIONS.len()).unwrap());
        drop_table(&admin, &table).await;
    }

    #[tokio::test]
    async fn missing_table_without_migrate_is_a_config_error() {
        let Some(db) = TestDb::new("nomigrate").await else {
            return;
        };
        let opts = SqlOptions {
            table: format!("idem_t_absent_{}", std::process::id()),
            migrate: false,
            ..SqlOptions::default()
        };
        match from_pool(db.admin.clone(), &opts).await {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("POSTGRES_SCHEMA_SQL"), "{message}")
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
        let bad = SqlOptions {
            table: "a.b.c".into(),
            migrate: true,
            ..SqlOptions::default()
        };
        assert!(matches!(
            from_pool(db.admin.clone(), &bad).await,
            Err(IdemError::Config { .. })
        ));
        db.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn record_wakes_waiters_in_other_processes() {
        let Some(db) = TestDb::new("wake").await else {
            return;
        };
        let hub = Arc::new(WakeHub::default());
        db.store.attach_wakers(hub.clone());
        let wait = |id: &OperationId| hub.register(id, 10).expect("register waiter");

        // Until the listener is subscribed, NOTIFY by hand: this proves it is listening.
        let probe = op("probe");
        let waiter = wait(&probe);
        let payload = serde_json::to_string(&probe).unwrap();
        let listening = async {
            loop {
                let notified = waiter.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                sqlx::query("SELECT pg_notify('idem_wake', $1)")
                    .bind(&payload)
                    .execute(&db.admin)
                    .await
                    .unwrap();
                if tokio::time::timeout(Duration::from_millis(200), notified)
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(30), listening)
            .await
            .expect("the wake listener never subscribed");

        // Another process (the admin pool) records; the waiter announced itself first.
        let id = op("w-1");
        let Claim::Acquired { epoch, .. } = claim(&db.store, &id, FP, LEASE).await else {
            panic!("fresh claim expected");
        };
        let waiter = wait(&id);
        let notified = waiter.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        db.store.announce_wait(&id).await.unwrap();
        let other = from_pool(
            db.admin.clone(),
            &SqlOptions {
                table: db.table.clone(),
                migrate: false,
                ..SqlOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(
            other.record(&id, epoch, &outcome("1"), DAY).await.unwrap(),
            Fence::Held
        );
        tokio::time::timeout(Duration::from_secs(30), notified)
            .await
            .expect("record did not wake the waiter");

        // Without an announced waiter, nothing is sent.
        let quiet = op("w-2");
        let Claim::Acquired { epoch, .. } = claim(&db.store, &quiet, FP, LEASE).await else {
            panic!("fresh claim expected");
        };
        let table = TableName::parse(&db.table, true).unwrap();
        let release = Stmt::render::<Pg>(Pg::sql("release"), &table);
        let payload = serde_json::to_string(&quiet).unwrap();
        let row = sqlx::query(&release.sql)
            .bind(&quiet.scope)
            .bind(&quiet.name)
            .bind(&quiet.key)
            .bind(epoch as i64)
            .bind(&payload)
            .bind(DAY.as_millis() as i64)
            .fetch_one(&db.admin)
            .await
            .unwrap();
        assert_eq!(
            (row.get::<i64, _>("held"), row.get::<i64, _>("woke")),
            (1, 0)
        );
        db.cleanup().await;
    }

    #[tokio::test]
    async fn listener_stops_with_the_store() {
        let Some(db) = TestDb::new("listener").await else {
            return;
        };
        let hub = Arc::new(WakeHub::default());
        db.store.attach_wakers(hub.clone());
        // The task holds a clone of the hub; dropping the store aborts it and frees it.
        assert_eq!(Arc::strong_count(&hub), 2);
        let TestDb {
            store,
            admin,
            table,
        } = db;
        drop(store);
        tokio::time::timeout(Duration::from_secs(10), async {
            while Arc::strong_count(&hub) > 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("listener task still running after the store was dropped");
        drop_table(&admin, &table).await;
    }

    #[test]
    fn transient_sqlstates_are_retryable() {
        for code in [
            "40001", "40P01", "55P03", "08006", "57P01", "53300", "25006",
        ] {
            assert!(retryable_code(code), "{code}");
        }
        for code in ["23505", "42P01", "42601", "22P02"] {
            assert!(!retryable_code(code), "{code}");
        }
        // Answered, if with a refusal: `fail_open` must not run the body on these.
        for code in ["25006", "53300", "40001", "55P03"] {
            assert!(!unreachable_code(code), "{code}");
        }
    }

    /// A database error as the one raised on a batch's connection.
    fn db_error(code: &str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(CopiedDbError {
            message: format!("error {code}"),
            code: Some(code.to_owned()),
            kind: sqlx::error::ErrorKind::Other,
        }))
    }

    /// A batch of fresh claims of `n` keys, and where each caller's answer arrives.
    #[allow(clippy::type_complexity)]
    fn fresh_batch(
        n: usize,
    ) -> (
        Vec<Waiting>,
        Vec<tokio::sync::oneshot::Receiver<Result<Vec<Row>, sqlx::Error>>>,
    ) {
        (0..n)
            .map(|i| {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let op = Gathered::Fresh {
                    id: op(&format!("batch-{i}")),
                    fp: FP,
                    lease_ms: 60_000,
                };
                (Waiting { op, reply }, answer)
            })
            .unzip()
    }

    /// Each caller's error from a failed batch, as the store maps it.
    async fn failed(
        answers: Vec<tokio::sync::oneshot::Receiver<Result<Vec<Row>, sqlx::Error>>>,
    ) -> Vec<(Option<String>, StoreError)> {
        let mut out = Vec::new();
        for answer in answers {
            let e = answer
                .await
                .expect("every caller is answered")
                .expect_err("a caller of the failed batch got rows");
            let code = match &e {
                sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
                _ => None,
            };
            out.push((code, map_err(e)));
        }
        out
    }

    /// A connection-level failure of a batch (SQLSTATE classes 08 and 57P) is every
    /// caller's, unreachable and retryable as from its own statement; a refusal on a
    /// live connection is issued again call by call.
    #[tokio::test]
    async fn a_lost_connection_reaches_every_caller_of_a_batch_as_unreachable() {
        for code in ["57P01", "57P02", "57P03", "08006", "08003"] {
            let e = db_error(code);
            assert!(!refused(&e), "{code} was taken for a refusal");
            let (batch, answers) = fresh_batch(3);
            fail_all(batch, &e);
            for (got, e) in failed(answers).await {
                assert_eq!(got.as_deref(), Some(code));
                assert!(e.retryable && e.unreachable, "{code}: {e:?}");
                assert_eq!(
                    e.to_string(),
                    format!("error returned from database: error {code}")
                );
            }
        }
        for code in ["23505", "42P01", "25006", "53300"] {
            assert!(refused(&db_error(code)), "{code}");
        }
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!refused(&io));
        let (batch, answers) = fresh_batch(2);
        fail_all(batch, &io);
        for (_, e) in failed(answers).await {
            assert!(e.retryable && e.unreachable, "{e:?}");
        }
    }

    /// Runs the batch statement `name` over `ops` and returns its rows.
    async fn batch_rows(db: &TestDb, name: &str, ops: &[Gathered]) -> Vec<Row> {
        let table = TableName::parse(&db.table, true).unwrap();
        let stmt = Stmt::render::<Pg>(Pg::sql(name), &table);
        let calls: Vec<_> = ops.iter().map(Gathered::args).collect();
        let query = bind_batch(&stmt, &calls).unwrap();
        let rows = query
            .fetch_all(&db.admin)
            .await
            .expect("the batch statement runs");
        rows.iter().map(|r| decode_row(r).unwrap()).collect()
    }

    /// Batches decide released records as the lone statements do: a record at the
    /// released epoch is fenced, and a claim acquires at once, resuming the steps, under
    /// `on_takeover = unknown` too.
    #[tokio::test]
    async fn batches_resume_released_steps() {
        let Some(db) = TestDb::new("batchsteps").await else {
            return;
        };
        let ids = [op("r-1"), op("r-2")];
        let mut released = Vec::new();
        for id in &ids {
            let epoch = epoch_of(claim(&db.store, id, FP, LEASE).await);
            let step = outcome("1");
            let fence = db.store.record_step(id, epoch, "charge", &step).await;
            assert_eq!(fence.unwrap(), Fence::Held);
            assert_eq!(db.store.release(id, epoch, DAY).await.unwrap(), Fence::Held);
            released.push(epoch);
        }
        let col = |row: &Row, name: &str| {
            row.0
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no `{name}` in {row:?}"))
        };
        let records: Vec<_> = ids
            .iter()
            .zip(&released)
            .map(|(id, &epoch)| Gathered::Record {
                id: id.clone(),
                epoch: i64::try_from(epoch).unwrap(),
                outcome: outcome("2"),
                retain: DAY,
                payload: String::new(),
            })
            .collect();
        let rows = batch_rows(&db, "record_batch", &records).await;
        assert_eq!(rows.len(), 2);
        for row in &rows {
            assert_eq!(col(row, "held"), Val::Int(0), "{row:?}");
        }
        let claims: Vec<_> = ids
            .iter()
            .map(|id| Gathered::Claim {
                id: id.clone(),
                fp: FP,
                lease_ms: 60_000,
                to_unknown: true,
            })
            .collect();
        let rows = batch_rows(&db, "claim_batch", &claims).await;
        assert_eq!(rows.len(), 2);
        for row in &rows {
            assert_eq!(col(row, "mine"), Val::Bool(true), "{row:?}");
            assert_eq!(col(row, "state"), Val::Int(0), "{row:?}");
            assert_eq!(col(row, "taken_over"), Val::Bool(false), "{row:?}");
            assert_eq!(col(row, "resume"), Val::Bool(true), "{row:?}");
        }
        for id in &ids {
            assert_eq!(db.store.steps(id).await.unwrap().len(), 1);
        }
        db.cleanup().await;
    }

    /// The same through a real batch: its statement ends its own session
    /// (`pg_terminate_backend`, SQLSTATE 57P01), and every caller gets that error, not
    /// a statement of its own on a new connection.
    #[tokio::test]
    async fn a_batch_whose_session_ends_fails_each_caller_as_unreachable() {
        let Some(db) = TestDb::new("batchlost").await else {
            return;
        };
        let table = TableName::parse(&db.table, true).unwrap();
        let r = |name: &str| Stmt::render::<Pg>(Pg::sql(name), &table);
        let pool = db.store.dialect.pool.clone();
        let group = Arc::new(PgGroup {
            owned: Some(Arc::new(Conns::new((*pool.connect_options()).clone(), 2))),
            pool,
            claim_fresh: r("claim_fresh"),
            claim: r("claim"),
            record: r("record"),
            claim_fresh_batch: Stmt::render::<Pg>(
                "SELECT pg_terminate_backend(pg_backend_pid()), \
                 cardinality(:scopes::text[])::int8 AS ord",
                &table,
            ),
            claim_batch: r("claim_batch"),
            record_batch: r("record_batch"),
            claims: [Gather::new(1), Gather::new(1)],
            fresh: Gather::new(1),
            records: Gather::new(1),
        });
        let (batch, answers) = fresh_batch(3);
        write_batch(group, batch).await;
        for (code, e) in failed(answers).await {
            assert_eq!(code.as_deref(), Some("57P01"), "{e}");
            assert!(e.retryable && e.unreachable, "{e:?}");
        }
        db.cleanup().await;
    }
}
