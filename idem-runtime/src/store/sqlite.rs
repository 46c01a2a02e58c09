//! The embedded store's dialect: one SQLite table, a file in WAL mode or a pinned
//! in-memory database.
//!
//! Every method is one statement, or a few in one transaction where steps are involved
//! (recording a step, a release or retry that keeps a record with steps); a trigger
//! deletes a record's steps with it. Times come from SQLite's clock inside the statement
//! (`unixepoch('subsec')`, fixed for the whole statement), never from the application.
//! SQLite has one writer, so the claim's upsert never races: it is issued once.
//! Durability, group commit and the store across processes are described for users in
//! [`guide::sqlite`](crate::guide::sqlite).

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Executor;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use tokio::sync::oneshot;

use super::OperationId;
use super::engine::{
    Arg, Dialect, Gathered, On, Row, SqlDb, SqlStore, Stmt, bind, decode_row, migrate, open_error,
    statements,
};
use super::group::Gather;
use super::sql_common::{self, SqlOptions, TableName};
use crate::error::{IdemError, StoreError};

/// The operations table as idem creates it on SQLite, with the default table name.
///
/// For teams that run their own DDL (`migrate(false)`). The statements are idempotent
/// but for one: SQLite cannot add a column only if it is missing, so the `ALTER TABLE`
/// that adds `steps` fails on a table that has it (idem's own migrations skip it there).
pub const SQLITE_SCHEMA_SQL: &str = concat!(
    include_str!("../../migrations/sqlite/0001_create_operations.sql"),
    "\n",
    include_str!("../../migrations/sqlite/0002_epochs_and_key_mode.sql"),
    "\n",
    include_str!("../../migrations/sqlite/0003_steps.sql"),
);

/// The migrations, in order: (version, DDL in the default table name).
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../migrations/sqlite/0001_create_operations.sql"),
    ),
    (
        2,
        include_str!("../../migrations/sqlite/0002_epochs_and_key_mode.sql"),
    ),
    (3, include_str!("../../migrations/sqlite/0003_steps.sql")),
];

/// The store's clock in unix milliseconds. SQLite fixes `'now'` for the duration of one
/// `sqlite3_step`, so every use within a statement sees the same instant.
const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// How long a statement waits for another connection's write lock before `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The SQLite dialect: a pool over one database.
#[derive(Debug)]
pub struct Sqlite {
    pub(crate) pool: SqlitePool,
    /// Claims, records and the other writes, gathered into shared transactions.
    writes: Arc<GroupCommit>,
    /// The statements gathered claims and records run; `None` on the dialect that only
    /// migrates, before the store's statements exist.
    batch: Option<Arc<BatchSql>>,
}

impl Sqlite {
    fn new(pool: SqlitePool) -> Sqlite {
        Sqlite {
            pool,
            writes: Arc::new(Gather::new(1)),
            batch: None,
        }
    }

    /// The dialect for the store on `table`: its claims and records gather.
    fn for_table(pool: SqlitePool, table: &TableName) -> Sqlite {
        let r = |name: &str| Stmt::render::<Sqlite>(Sqlite::sql(name), table);
        Sqlite {
            batch: Some(Arc::new(BatchSql {
                claim: r("claim"),
                record: r("record"),
                claim_batch: r("claim_batch"),
                record_batch: r("record_batch"),
            })),
            ..Sqlite::new(pool)
        }
    }
}

/// Group commit: SQLite has one writer and every commit is an fsync, so concurrent
/// claims, records and other writes are gathered (one batch at a time) into one
/// transaction, each caller answered with its own rows. A lone write runs alone.
type GroupCommit = Gather<Pending>;

/// What a batch runs for the claims and records in it.
#[derive(Debug)]
struct BatchSql {
    /// A claim alone (`claim.sql`).
    claim: Stmt,
    /// A record alone (`record.sql`).
    record: Stmt,
    /// The claims of new keys, many callers' in one statement: each statement is a
    /// crossing to the connection's thread, which costs more than the row it writes.
    claim_batch: Stmt,
    /// Records, many callers' in one statement.
    record_batch: Stmt,
}

/// A write waiting for its batch.
#[derive(Debug)]
struct Pending {
    work: Work,
    reply: oneshot::Sender<Result<Vec<Row>, sqlx::Error>>,
}

/// What a waiting write runs.
#[derive(Debug)]
enum Work {
    /// Any statement.
    Stmt {
        sql: String,
        /// Several statements ([`is_script`]): run alone, they take a transaction of
        /// their own.
        script: bool,
        args: Vec<OwnedArg>,
    },
    /// A claim or record, which a batch may run in one statement with others.
    Op(Gathered),
}

/// An [`Arg`] that outlives its caller's borrow, for a write run by another task.
#[derive(Debug)]
enum OwnedArg {
    Text(String),
    OptText(Option<String>),
    Bytes(Vec<u8>),
    Int(i64),
    OptInt(Option<i64>),
    Bool(bool),
}

impl OwnedArg {
    fn from(a: Arg<'_>) -> OwnedArg {
        match a {
            Arg::Text(t) => OwnedArg::Text(t.to_owned()),
            Arg::OptText(t) => OwnedArg::OptText(t.map(str::to_owned)),
            Arg::Bytes(b) => OwnedArg::Bytes(b.to_vec()),
            Arg::Int(i) => OwnedArg::Int(i),
            Arg::OptInt(i) => OwnedArg::OptInt(i),
            Arg::Bool(b) => OwnedArg::Bool(b),
        }
    }

    fn arg(&self) -> Arg<'_> {
        match self {
            OwnedArg::Text(t) => Arg::Text(t),
            OwnedArg::OptText(t) => Arg::OptText(t.as_deref()),
            OwnedArg::Bytes(b) => Arg::Bytes(b),
            OwnedArg::Int(i) => Arg::Int(*i),
            OwnedArg::OptInt(i) => Arg::OptInt(*i),
            OwnedArg::Bool(b) => Arg::Bool(*b),
        }
    }
}

impl Pending {
    async fn run<'c, E>(&self, on: E, sql: Option<&BatchSql>) -> Result<Vec<Row>, sqlx::Error>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        match (&self.work, sql) {
            (Work::Stmt { sql, args, .. }, _) => {
                rows(on, sql, args.iter().map(OwnedArg::arg).collect()).await
            }
            (Work::Op(op), Some(sql)) => run_op(on, sql, op).await,
            (Work::Op(_), None) => Err(sqlx::Error::Protocol(
                "a claim or record gathered before the store's statements exist".into(),
            )),
        }
    }

    /// Runs the write on its own: in a transaction if it is a script, so that its
    /// statements take effect together.
    async fn run_alone(
        &self,
        pool: &SqlitePool,
        sql: Option<&BatchSql>,
    ) -> Result<Vec<Row>, sqlx::Error> {
        if !matches!(self.work, Work::Stmt { script: true, .. }) {
            return self.run(pool, sql).await;
        }
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows = self.run(&mut *tx, sql).await?;
        tx.commit().await?;
        Ok(rows)
    }
}

/// Runs a claim's or record's own statement, as the engine would issue it.
async fn run_op<'c, E>(on: E, sql: &BatchSql, op: &Gathered) -> Result<Vec<Row>, sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
{
    let mut named = op.args();
    let stmt = match op {
        // SQLite has no `claim_fresh.sql`, so the engine sends none; no row would send
        // one on to the full claim, which decides every case.
        Gathered::Fresh { .. } => return Ok(Vec::new()),
        Gathered::Claim { .. } => {
            named.push(("token", Arg::Int(sql_common::claim_token())));
            &sql.claim
        }
        Gathered::Record { .. } => &sql.record,
    };
    let args = stmt
        .args(&named)
        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    rows(on, &stmt.sql, args).await
}

/// Whether a statement file holds several statements, one per line-ending `;` (sqlx runs
/// them in order, binding each its numbered parameters, and returns every one's rows).
fn is_script(sql: &str) -> bool {
    sql.contains(";\n")
}

/// Runs one statement on `on` and reads its rows.
async fn rows<'c, E>(on: E, sql: &str, args: Vec<Arg<'_>>) -> Result<Vec<Row>, sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
{
    let rows = bind(sqlx::query(sql), args).fetch_all(on).await?;
    rows.iter().map(decode_row).collect()
}

/// Queues one write for the next batch and waits for its rows.
async fn write(sqlite: &Sqlite, work: Work) -> Result<Vec<Row>, sqlx::Error> {
    let (reply, answer) = oneshot::channel();
    let (pool, sql) = (&sqlite.pool, &sqlite.batch);
    let batch = |batch| write_batch(pool.clone(), sql.clone(), batch);
    sqlite
        .writes
        .submit(Pending { work, reply }, answer, batch)
        .await
        .unwrap_or_else(|| Err(lost_batch()))
}

fn lost_batch() -> sqlx::Error {
    sqlx::Error::Protocol(
        "a group-commit batch ended without answering (its write panicked)".into(),
    )
}

/// Writes `batch` in one transaction and answers each write. If any write or the commit
/// fails, the transaction is rolled back whole and every write runs again alone, so one
/// write's failure is its own and no write takes effect twice.
async fn write_batch(pool: SqlitePool, sql: Option<Arc<BatchSql>>, batch: Vec<Pending>) {
    let sql = sql.as_deref();
    if batch.len() > 1 {
        let together = async {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            let mut answers = in_one_statement(&mut tx, sql, &batch).await?;
            for (p, answer) in batch.iter().zip(&mut answers) {
                if answer.is_none() {
                    *answer = Some(p.run(&mut *tx, sql).await?);
                }
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(answers)
        };
        if let Ok(answers) = together.await {
            for (p, rows) in batch.into_iter().zip(answers) {
                let _ = p.reply.send(Ok(rows.unwrap_or_default()));
            }
            return;
        }
        // Dropping the transaction rolled it back: nothing of the batch took effect.
    }
    // A lone write, or a failed batch's writes, each alone.
    for p in batch {
        let r = p.run_alone(&pool, sql).await;
        let _ = p.reply.send(r);
    }
}

/// A batch's claims, and its records, each kind in one statement where it has two or
/// more with distinct keys (`claim_batch.sql`, `record_batch.sql`), before its other
/// writes: the rows of each write answered, `None` for each left to run on its own. A
/// claim whose key exists is left, for `claim.sql` to decide; a key's second claim or
/// record is left, as a statement changes a row once, and so is an operation whose
/// names hold a NUL. The writes of one batch are concurrent, so this order is as good
/// as their arrival's.
async fn in_one_statement(
    conn: &mut SqliteConnection,
    sql: Option<&BatchSql>,
    batch: &[Pending],
) -> Result<Vec<Option<Vec<Row>>>, sqlx::Error> {
    let mut answers: Vec<Option<Vec<Row>>> = batch.iter().map(|_| None).collect();
    let Some(sql) = sql else {
        return Ok(answers);
    };
    for records in [false, true] {
        let mut seen = HashSet::new();
        let picked: Vec<(usize, &Gathered)> = batch
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match &p.work {
                Work::Op(op) if matches!(op, Gathered::Record { .. }) == records => Some((i, op)),
                _ => None,
            })
            // Older SQLites' JSON functions (3.40, for one) cut a string at an escaped
            // NUL; the bundled one keeps it whole, but a build may link the system's.
            // So an operation named with a NUL runs its own statement.
            .filter(|(_, op)| {
                let id = op.id();
                ![&id.scope, &id.name, &id.key]
                    .iter()
                    .any(|s| s.contains('\0'))
            })
            .filter(|(_, op)| seen.insert(op.id()))
            .collect();
        if picked.len() < 2 {
            continue;
        }
        let (stmt, fields) = if records {
            (&sql.record_batch, RECORD_FIELDS)
        } else {
            (&sql.claim_batch, CLAIM_FIELDS)
        };
        let elements = picked
            .iter()
            .map(|(_, op)| json_element(&op.args(), fields))
            .collect::<Result<Vec<_>, _>>()?;
        let json = serde_json::Value::Array(elements).to_string();
        let mut by_id: HashMap<OperationId, Row> = HashMap::new();
        for row in rows(&mut *conn, &stmt.sql, vec![Arg::Text(&json)]).await? {
            by_id.insert(row_id(&row)?, row);
        }
        for (i, op) in picked {
            answers[i] = match (by_id.remove(op.id()), op) {
                (Some(row), _) => Some(vec![row]),
                // The fence did not hold, or (from the engine's plain insert) the key
                // exists: no row, as their own statements answer.
                (None, Gathered::Record { .. } | Gathered::Fresh { .. }) => Some(Vec::new()),
                (None, Gathered::Claim { .. }) => None,
            };
        }
    }
    Ok(answers)
}

/// The parameters of `claim.sql` that `claim_batch.sql` takes, in its array's order.
const CLAIM_FIELDS: &[&str] = &["scope", "name", "key", "fp", "lease_ms"];
/// The parameters of `record.sql` that `record_batch.sql` takes, in its array's order.
const RECORD_FIELDS: &[&str] = &[
    "scope",
    "name",
    "key",
    "epoch",
    "outcome",
    "is_err",
    "version",
    "retain_ms",
];

/// One write's element of a batch's JSON array: `fields` of its parameters, bytes in
/// hex (JSON has no bytes; the statement turns them back with `unhex`) and flags as
/// 0 or 1, as SQLite stores them.
fn json_element(
    named: &[(&'static str, Arg<'_>)],
    fields: &[&str],
) -> Result<serde_json::Value, sqlx::Error> {
    use serde_json::Value;
    let value = |field: &str| {
        let arg = named
            .iter()
            .find(|(n, _)| *n == field)
            .map(|&(_, a)| a)
            .ok_or_else(|| sqlx::Error::Protocol(format!("a batched write has no `{field}`")))?;
        Ok(match arg {
            Arg::Text(t) | Arg::OptText(Some(t)) => Value::from(t),
            Arg::Int(i) | Arg::OptInt(Some(i)) => Value::from(i),
            Arg::Bool(b) => Value::from(i64::from(b)),
            Arg::Bytes(b) => Value::from(crate::secret::hex(b)),
            Arg::OptText(None) | Arg::OptInt(None) => Value::Null,
        })
    };
    fields.iter().map(|f| value(f)).collect()
}

/// The operation a batch statement's row is of: its `scope`, `name` and `key`.
fn row_id(row: &Row) -> Result<OperationId, sqlx::Error> {
    let text = |name| {
        row.text(name)
            .map_err(|e| sqlx::Error::Protocol(e.to_string()))
    };
    Ok(OperationId {
        scope: text("scope")?,
        name: text("name")?,
        key: text("key")?,
    })
}

/// The SQLite store.
pub(crate) type SqliteStore = SqlStore<Sqlite>;

impl SqlDb for sqlx::Sqlite {
    type Dialect = Sqlite;
}

#[async_trait::async_trait]
impl Dialect for Sqlite {
    type Db = sqlx::Sqlite;
    type Conn = SqliteConnection;
    const NOW: &'static str = NOW_MS;
    const NEXT_EPOCH: &'static str = "(SELECT last_epoch + 1 FROM {meta} WHERE id = 0)";
    const SCHEMA: &'static str = "SQLITE_SCHEMA_SQL";

    statements!("sqlite", "peek", "claim_batch", "record_batch");

    fn placeholder(n: usize) -> String {
        format!("?{n}")
    }

    fn map_err(e: sqlx::Error) -> StoreError {
        sql_common::map_sqlx(e, retryable_code, unreachable_code)
    }

    async fn fetch(
        &self,
        on: On<'_, SqliteConnection>,
        stmt: &Stmt,
        args: Vec<Arg<'_>>,
    ) -> Result<Vec<Row>, sqlx::Error> {
        match on {
            On::Hot => {
                let work = Work::Stmt {
                    sql: stmt.sql.clone(),
                    script: is_script(&stmt.sql),
                    args: args.into_iter().map(OwnedArg::from).collect(),
                };
                write(self, work).await
            }
            On::Pool if is_script(&stmt.sql) => {
                let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
                let rows = rows(&mut *tx, &stmt.sql, args).await?;
                tx.commit().await?;
                Ok(rows)
            }
            On::Pool => rows(&self.pool, &stmt.sql, args).await,
            On::Conn(conn) => rows(conn, &stmt.sql, args).await,
        }
    }

    /// `BEGIN IMMEDIATE` takes the write lock at once: processes opening the same file
    /// together migrate one after another (each waits up to the busy timeout).
    async fn begin_migrations(
        &self,
        _: &TableName,
    ) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }

    /// A migration's `ALTER TABLE ... ADD COLUMN` is left out where the table has the
    /// column already: SQLite has no `IF NOT EXISTS` for columns, and a table created from
    /// [`SQLITE_SCHEMA_SQL`] is adopted by applying every migration to it.
    async fn run_script(&self, conn: &mut SqliteConnection, sql: &str) -> Result<(), sqlx::Error> {
        if !sql.contains("ADD COLUMN") {
            return conn.execute(sql).await.map(drop);
        }
        let mut script = String::with_capacity(sql.len());
        for (text, added) in column_additions(sql) {
            if let Some((table, column)) = added {
                let has: Option<i64> =
                    sqlx::query_scalar("SELECT 1 FROM pragma_table_info(?1) WHERE name = ?2")
                        .bind(table)
                        .bind(column)
                        .fetch_optional(&mut *conn)
                        .await?;
                if has.is_some() {
                    continue;
                }
            }
            script.push_str(text);
        }
        conn.execute(script.as_str()).await.map(drop)
    }

    async fn execute(&self, stmt: &Stmt, args: Vec<Arg<'_>>) -> Result<u64, sqlx::Error> {
        let done = bind(sqlx::query(&stmt.sql), args)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    fn claim_token(&self) -> Option<i64> {
        Some(sql_common::claim_token())
    }

    /// Always, on a store's dialect: SQLite has one writer, so every write waits for
    /// the batch before it anyway.
    fn gathers(&self) -> bool {
        self.batch.is_some()
    }

    async fn gathered(&self, op: Gathered) -> Option<Result<Vec<Row>, sqlx::Error>> {
        Some(write(self, Work::Op(op)).await)
    }

    async fn from_pool(pool: SqlitePool, opts: &SqlOptions) -> Result<SqliteStore, IdemError> {
        from_pool(pool, opts).await
    }
}

/// `sql` cut into pieces that rejoin into it: each `ALTER TABLE <table> ADD COLUMN
/// <column> ...;` (from its line to the line that ends it) with its table and column,
/// unquoted, and the text between them.
fn column_additions(sql: &str) -> Vec<(&str, Option<(&str, &str)>)> {
    let mut out = Vec::new();
    let (mut start, mut at, mut adding) = (0, 0, None);
    for line in sql.split_inclusive('\n') {
        if adding.is_none() {
            let words: Vec<&str> = line.split_whitespace().take(6).collect();
            if let ["ALTER", "TABLE", table, "ADD", "COLUMN", column] = words[..] {
                if start < at {
                    out.push((&sql[start..at], None));
                }
                start = at;
                adding = Some((table.trim_matches('"'), column.trim_matches('"')));
            }
        }
        at += line.len();
        if adding.is_some() && line.trim_end().ends_with(';') {
            out.push((&sql[start..at], adding.take()));
            start = at;
        }
    }
    if start < sql.len() {
        out.push((&sql[start..], adding));
    }
    out
}

/// Opens (creating if missing) the database at `url` — `sqlite://path`, `sqlite:path`,
/// a bare path, or `sqlite::memory:` — and the idem table in it.
pub(crate) async fn open(url: &str, opts: &SqlOptions) -> Result<SqliteStore, IdemError> {
    let table = TableName::parse(&opts.table, false)?;
    let memory = is_memory(url);
    let mut connect = if url.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(url).map_err(|e| IdemError::Config {
            message: format!(
                "invalid SQLite URL `{url}`: {e}; expected `sqlite://path/to/file.db`, \
                 `sqlite::memory:` or a file path"
            ),
        })?
    } else {
        SqliteConnectOptions::new().filename(url)
    };
    // Create the file unless the URL chose a mode itself (`mode=rw` means "must exist").
    if !url.contains("mode=") {
        connect = connect.create_if_missing(true);
    }
    // FULL, not WAL's usual NORMAL: under NORMAL a power loss can drop the last
    // commits, and a lost claim or record lets a retry run the body a second time.
    connect = connect
        .busy_timeout(BUSY_TIMEOUT)
        .synchronous(SqliteSynchronous::Full);
    let pool = if memory {
        // An in-memory database lives as long as a connection to it. sqlx gives
        // `sqlite::memory:` a unique shared-cache name, so every connection of this pool
        // would see it, but a pool closes idle connections, and the database would vanish
        // with the last one. One connection, opened at once and never retired, keeps it
        // alive for the life of the store (and avoids shared-cache table locks).
        SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(connect)
            .await
    } else {
        // WAL lets readers (the replay fast path) run beside the one writer.
        SqlitePoolOptions::new()
            .test_before_acquire(false)
            .connect_with(connect.journal_mode(SqliteJournalMode::Wal))
            .await
    }
    .map_err(|e| IdemError::Config {
        message: format!(
            "cannot open SQLite database at `{url}`: {e}; check the path exists and is writable"
        ),
    })?;
    prepare(pool, table, opts).await
}

/// Uses an application's pool; creates the idem table in it unless `opts.migrate` is false.
pub(crate) async fn from_pool(
    pool: SqlitePool,
    opts: &SqlOptions,
) -> Result<SqliteStore, IdemError> {
    let table = TableName::parse(&opts.table, false)?;
    prepare(pool, table, opts).await
}

fn is_memory(url: &str) -> bool {
    let path = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    path == ":memory:" || query.split('&').any(|p| p == "mode=memory")
}

async fn prepare(
    pool: SqlitePool,
    table: TableName,
    opts: &SqlOptions,
) -> Result<SqliteStore, IdemError> {
    if opts.migrate {
        migrate(&Sqlite::new(pool.clone()), &table, MIGRATIONS)
            .await
            .map_err(|e| {
                open_error::<Sqlite>(
                    e,
                    format!(
                        "cannot create the idem table `{table}` in SQLite; check the database is \
                     writable, or create it yourself with `SQLITE_SCHEMA_SQL` and disable migrate"
                    ),
                )
            })?;
    }
    SqlStore::prepare(Sqlite::for_table(pool, &table), &table, &opts.key_mode).await
}

/// SQLite's primary result codes (the low byte of the extended code) that a retry can
/// clear: SQLITE_BUSY (5), SQLITE_LOCKED (6), SQLITE_PROTOCOL (15, a WAL lock race).
fn retryable_code(code: &str) -> bool {
    code.parse::<i32>()
        .is_ok_and(|c| matches!(c & 0xff, 5 | 6 | 15))
}

/// SQLite's primary result codes that mean the database cannot be reached at all:
/// SQLITE_IOERR (10) and SQLITE_CANTOPEN (14).
fn unreachable_code(code: &str) -> bool {
    code.parse::<i32>()
        .is_ok_and(|c| matches!(c & 0xff, 10 | 14))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::engine::Val;
    use crate::store::test_support::*;
    use crate::store::{Admin, Claim, Fence, Store};

    async fn memory() -> SqliteStore {
        open("sqlite::memory:", &SqlOptions::default())
            .await
            .expect("open in-memory store")
    }

    #[tokio::test]
    async fn table_names_are_validated_and_used() {
        let bad = SqlOptions {
            table: "idem ops".into(),
            migrate: true,
            ..SqlOptions::default()
        };
        assert!(matches!(
            open("sqlite::memory:", &bad).await,
            Err(IdemError::Config { .. })
        ));
        let missing = SqlOptions {
            table: "not_created".into(),
            migrate: false,
            ..SqlOptions::default()
        };
        match open("sqlite::memory:", &missing).await {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("SQLITE_SCHEMA_SQL"), "{message}")
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
        let custom = SqlOptions {
            table: "order".into(),
            migrate: true,
            ..SqlOptions::default()
        };
        let store = open("sqlite::memory:", &custom).await.unwrap();
        let id = op("o-8");
        assert_eq!(
            claim(&store, &id, FP, LEASE).await,
            Claim::Acquired {
                epoch: 1,
                takeover: false,
                resume: false
            }
        );
    }

    #[tokio::test]
    async fn shipped_schema_works_without_migrate() {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::raw_sql(SQLITE_SCHEMA_SQL)
            .execute(&pool)
            .await
            .unwrap();
        let opts = SqlOptions {
            migrate: false,
            ..SqlOptions::default()
        };
        let store = from_pool(pool, &opts).await.unwrap();
        let id = op("o-9");
        assert_eq!(
            claim(&store, &id, FP, LEASE).await,
            Claim::Acquired {
                epoch: 1,
                takeover: false,
                resume: false
            }
        );
    }

    /// A pool on a private in-memory database, holding its one connection for good.
    async fn memory_pool() -> SqlitePool {
        SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await
            .unwrap()
    }

    /// Steps work on a table made from the shipped schema and adopted by `migrate`
    /// (whose column is not added twice), and on a table from before steps, whose record
    /// survives the upgrade.
    #[tokio::test]
    async fn steps_on_an_adopted_table_and_an_upgraded_one() {
        let shipped = memory_pool().await;
        sqlx::raw_sql(SQLITE_SCHEMA_SQL)
            .execute(&shipped)
            .await
            .unwrap();
        let older = memory_pool().await;
        sqlx::raw_sql(concat!(
            include_str!("../../migrations/sqlite/0001_create_operations.sql"),
            include_str!("../../migrations/sqlite/0002_epochs_and_key_mode.sql"),
        ))
        .execute(&older)
        .await
        .unwrap();
        let unmigrated = SqlOptions {
            migrate: false,
            ..SqlOptions::default()
        };
        match from_pool(older.clone(), &unmigrated).await {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("SQLITE_SCHEMA_SQL"), "{message}")
            }
            other => panic!("an older table needs the migration, got {:?}", other.err()),
        }
        let old = op("o-old");
        // The older table's own claim, which knows nothing of steps.
        sqlx::query(
            "INSERT INTO idem_operations (scope, name, key, state, epoch, fingerprint, token, \
             lease_until_ms, created_ms, claimed_ms) VALUES (?1, ?2, ?3, 0, 7, ?4, 0, 0, 0, 0)",
        )
        .bind(&old.scope)
        .bind(&old.name)
        .bind(&old.key)
        .bind(&FP[..])
        .execute(&older)
        .await
        .unwrap();
        for (pool, kept) in [(shipped, None), (older, Some(7))] {
            let store = from_pool(pool, &SqlOptions::default()).await.unwrap();
            let found = store.get(&old).await.unwrap().map(|r| r.info.epoch);
            assert_eq!(found, kept, "the older record survives the upgrade");
            let id = op("o-steps");
            let epoch = epoch_of(claim(&store, &id, FP, LEASE).await);
            let step = outcome("1");
            let fence = store.record_step(&id, epoch, "charge", &step).await;
            assert_eq!(fence.unwrap(), Fence::Held);
            assert_eq!(store.release(&id, epoch, DAY).await.unwrap(), Fence::Held);
            match claim(&store, &id, FP, LEASE).await {
                Claim::Acquired { resume: true, .. } => {}
                other => panic!("a released record with steps resumes, got {other:?}"),
            }
            assert_eq!(store.steps(&id).await.unwrap()[0].outcome, step);
        }
    }

    #[test]
    fn column_additions_are_found_and_the_rest_kept() {
        let sql = "-- ALTER TABLE in a comment\nALTER TABLE \"t\" ADD COLUMN steps INTEGER\n    \
                   NOT NULL DEFAULT 0;\nCREATE TABLE x (a INTEGER);\n";
        let parts = column_additions(sql);
        let text: String = parts.iter().map(|(text, _)| *text).collect();
        assert_eq!(text, sql);
        let added: Vec<_> = parts.iter().filter_map(|(_, added)| *added).collect();
        assert_eq!(added, [("t", "steps")]);
        assert_eq!(parts.len(), 3, "{parts:?}");
    }

    /// A database file in the system temp dir, removed (with its WAL files) on drop.
    struct TempDb(std::path::PathBuf);

    impl TempDb {
        fn new(name: &str) -> TempDb {
            let path = std::env::temp_dir().join(format!("idem-{name}-{}.db", std::process::id()));
            let db = TempDb(path);
            db.remove();
            db
        }

        fn remove(&self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = self.0.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        }
    }

    impl Drop for TempDb {
        fn drop(&mut self) {
            self.remove();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn file_database_concurrent_claims_run_once() {
        let db = TempDb::new("concurrent");
        let path = db.0.to_str().unwrap().to_owned();
        // Several stores open the same new file at once, as several processes would.
        let opens = (0..4).map(|i| {
            let url = if i % 2 == 0 {
                format!("sqlite://{path}")
            } else {
                path.clone()
            };
            tokio::spawn(async move { open(&url, &SqlOptions::default()).await })
        });
        let mut stores = Vec::new();
        for handle in opens {
            stores.push(Arc::new(handle.await.unwrap().expect("concurrent open")));
        }
        let id = Arc::new(op("hot"));
        let barrier = Arc::new(tokio::sync::Barrier::new(50));
        let tasks: Vec<_> = (0..50)
            .map(|i| {
                let (store, id, barrier) = (
                    stores[i % stores.len()].clone(),
                    id.clone(),
                    barrier.clone(),
                );
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
                    epoch: 1,
                    takeover: false,
                    resume: false,
                } => acquired += 1,
                Claim::InFlight { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(acquired, 1);
        // The file persists across stores.
        drop(stores);
        let again = open(&path, &SqlOptions::default()).await.unwrap();
        assert!(matches!(
            claim(&again, &id, FP, LEASE).await,
            Claim::InFlight { .. }
        ));
    }

    #[tokio::test]
    async fn unopenable_path_says_what_to_check() {
        let url = "/nonexistent-idem-dir/sub/idem.db";
        match open(url, &SqlOptions::default()).await {
            Err(IdemError::Config { message }) => {
                assert!(
                    message.contains(url) && message.contains("writable"),
                    "{message}"
                );
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
    }

    #[test]
    fn memory_urls_are_recognised() {
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            ":memory:",
            "sqlite://x?mode=memory",
        ] {
            assert!(is_memory(url), "{url}");
        }
        for url in ["sqlite://data.db", "data.db", "sqlite:memory.db?mode=rwc"] {
            assert!(!is_memory(url), "{url}");
        }
    }

    fn pending(op: Gathered) -> Pending {
        Pending {
            work: Work::Op(op),
            reply: oneshot::channel().0,
        }
    }

    fn claim_op(key: &str) -> Gathered {
        Gathered::Claim {
            id: op(key),
            fp: FP,
            lease_ms: 60_000,
            to_unknown: false,
        }
    }

    fn record_op(key: &str, epoch: u64, body: &str) -> Gathered {
        Gathered::Record {
            id: op(key),
            epoch: epoch as i64,
            outcome: outcome(body),
            retain: DAY,
            payload: String::new(),
        }
    }

    /// A store on a new file of its own, removed when the `TempDb` drops.
    async fn file_store(name: &str) -> (TempDb, SqliteStore) {
        let db = TempDb::new(name);
        let store = open(db.0.to_str().unwrap(), &SqlOptions::default())
            .await
            .unwrap();
        (db, store)
    }

    /// Runs `batch`'s one-statement writes in a transaction of their own and commits.
    async fn batched(store: &SqliteStore, batch: &[Pending]) -> Vec<Option<Vec<Row>>> {
        let mut tx = store.dialect.pool.begin().await.unwrap();
        let answers = in_one_statement(&mut tx, store.dialect.batch.as_deref(), batch)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        answers
    }

    fn column(row: &Row, name: &str) -> Val {
        row.val(name).unwrap().clone()
    }

    /// A batch's claims of new keys and its records each run as one statement: every
    /// such write is answered by it, and what it cannot decide is left to its own
    /// statement.
    #[tokio::test]
    async fn a_batch_claims_new_keys_and_records_in_one_statement_each() {
        let (_db, store) = file_store("batch").await;
        let held = epoch_of(claim(&store, &op("held"), FP, LEASE).await);
        let taken = epoch_of(claim(&store, &op("taken"), FP, LEASE).await);
        let batch = [
            claim_op("a"),
            claim_op("b"),
            claim_op("a"),
            claim_op("taken"),
            record_op("held", held, "done"),
            record_op("taken", taken + 100, "not mine"),
            record_op("held", held, "again"),
        ]
        .map(pending);
        let answers = batched(&store, &batch).await;

        // New keys: claimed, each with an epoch of its own above those before.
        let mut epochs = Vec::new();
        for answer in &answers[..2] {
            let [row] = &answer.as_ref().expect("answered by the batch")[..] else {
                panic!("{answer:?}");
            };
            assert_eq!(column(row, "mine"), Val::Int(1));
            assert_eq!(column(row, "state"), Val::Int(0));
            let Val::Int(epoch) = column(row, "epoch") else {
                panic!("{row:?}");
            };
            epochs.push(epoch as u64);
        }
        assert!(
            epochs[0] != epochs[1] && epochs.iter().all(|&e| e > taken),
            "{epochs:?}"
        );
        // A key's second claim, and the claim of a key that exists: left to claim.sql.
        assert!(answers[2].is_none() && answers[3].is_none(), "{answers:?}");
        // Records: the fence held, the fence lost, and a key's second record left over.
        let [row] = &answers[4].as_ref().unwrap()[..] else {
            panic!("{answers:?}");
        };
        assert_eq!(column(row, "held"), Val::Int(1));
        assert_eq!(answers[5].as_deref().map(<[Row]>::len), Some(0));
        assert!(answers[6].is_none(), "{answers:?}");

        // What the statements wrote is what the store reads.
        match claim(&store, &op("held"), FP, LEASE).await {
            Claim::Completed(o) => assert_eq!(&o.body[..], b"done"),
            other => panic!("{other:?}"),
        }
        for (key, epoch) in [("a", epochs[0]), ("b", epochs[1])] {
            let fence = store.record(&op(key), epoch, &outcome(key), DAY).await;
            assert_eq!(fence.unwrap(), Fence::Held, "{key}");
        }
        let fence = store.record(&op("taken"), taken, &outcome("t"), DAY).await;
        assert_eq!(fence.unwrap(), Fence::Held);
    }

    /// A record batch finds each element's record by its key. The indexes on `state`
    /// tempt the planner into reading every record in a state for each element: a
    /// batch would cost a pass over the table.
    #[tokio::test]
    async fn a_record_batch_finds_each_record_by_its_key() {
        let store = memory().await;
        let stmt = &store.dialect.batch.as_ref().unwrap().record_batch;
        let plan: Vec<String> = sqlx::query(&format!("EXPLAIN QUERY PLAN {}", stmt.sql))
            .bind("[]")
            .fetch_all(&store.dialect.pool)
            .await
            .unwrap()
            .iter()
            .map(|row| sqlx::Row::get(row, "detail"))
            .collect();
        let of_table: Vec<&String> = plan.iter().filter(|d| d.contains(" t ")).collect();
        assert!(!of_table.is_empty(), "{plan:?}");
        for detail in of_table {
            assert!(
                detail.starts_with("SEARCH") && detail.ends_with("(scope=? AND name=? AND key=?)"),
                "{plan:?}"
            );
        }
    }

    /// Keys JSON must escape go through a batch unchanged; a key with a NUL, which an
    /// older SQLite's JSON functions would cut short, is left to its own statement.
    #[tokio::test]
    async fn a_batch_keeps_every_key_as_it_is() {
        let (_db, store) = file_store("batch-keys").await;
        let keys = [
            "quote\"d",
            "back\\slash",
            "line\nbreak",
            "ключ 🔑",
            "bell\u{7}",
            "nul\0a",
        ];
        let mut batch: Vec<Pending> = keys.iter().map(|k| pending(claim_op(k))).collect();
        batch.push(pending(claim_op("nul\0b")));
        let answers = batched(&store, &batch).await;
        let mut epochs = Vec::new();
        for (key, answer) in keys[..5].iter().zip(&answers) {
            let [row] = &answer.as_ref().expect("answered by the batch")[..] else {
                panic!("{key:?}: {answer:?}");
            };
            assert_eq!(row_id(row).unwrap().key, *key);
            let Val::Int(epoch) = column(row, "epoch") else {
                panic!("{row:?}");
            };
            epochs.push(epoch as u64);
        }
        assert!(answers[5].is_none() && answers[6].is_none(), "{answers:?}");
        let records = keys[..5]
            .iter()
            .zip(&epochs)
            .map(|(key, &epoch)| pending(record_op(key, epoch, key)))
            .collect::<Vec<_>>();
        let answers = batched(&store, &records).await;
        for (key, answer) in keys.iter().zip(&answers) {
            assert_eq!(answer.as_ref().map(Vec::len), Some(1), "{key:?}");
            match claim(&store, &op(key), FP, LEASE).await {
                Claim::Completed(o) => assert_eq!(&o.body[..], key.as_bytes()),
                other => panic!("{key:?}: {other:?}"),
            }
        }
        // Nothing was written under the key a NUL would be cut to.
        for key in ["nul", "nul\0a", "nul\0b"] {
            let fresh = claim(&store, &op(key), FP, LEASE).await;
            assert!(
                matches!(fresh, Claim::Acquired { .. }),
                "{key:?}: {fresh:?}"
            );
        }
    }

    /// Many callers' fresh calls at once on a file: each claims with an epoch of its
    /// own, records its own outcome, and reads back its own.
    #[tokio::test]
    async fn concurrent_fresh_calls_each_keep_their_own() {
        let (_db, store) = file_store("gathered").await;
        let store = Arc::new(store);
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let (store, barrier) = (store.clone(), barrier.clone());
                tokio::spawn(async move {
                    let id = op(&format!("k{i}"));
                    barrier.wait().await;
                    let epoch = epoch_of(claim(&*store, &id, FP, LEASE).await);
                    let body = format!("outcome {i}");
                    let fence = store.record(&id, epoch, &outcome(&body), DAY).await;
                    assert_eq!(fence.unwrap(), Fence::Held);
                    match claim(&*store, &id, FP, LEASE).await {
                        Claim::Completed(o) => assert_eq!(&o.body[..], body.as_bytes()),
                        other => panic!("{other:?}"),
                    }
                    epoch
                })
            })
            .collect();
        let mut epochs = HashSet::new();
        for task in tasks {
            assert!(epochs.insert(task.await.unwrap()), "an epoch repeated");
        }
    }

    #[test]
    fn tokens_do_not_repeat() {
        let tokens: std::collections::HashSet<i64> =
            (0..10_000).map(|_| sql_common::claim_token()).collect();
        assert_eq!(tokens.len(), 10_000);
    }

    #[test]
    fn busy_and_locked_are_retryable() {
        assert!(retryable_code("5") && retryable_code("517") && retryable_code("6"));
        assert!(!retryable_code("19") && !retryable_code("2067") && !retryable_code("1"));
    }
}
