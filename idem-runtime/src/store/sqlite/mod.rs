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
//!
//! This file holds the dialect, its migrations and its opening; `batch.rs`, the group
//! commit that gathers concurrent writes into one transaction; `open.rs`,
//! `Idem::sqlite` and `IdemBuilder::sqlite`.

mod batch;
mod open;

use std::str::FromStr;
use std::time::Duration;

use sqlx::Executor;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};

use super::engine::{
    self, Arg, Dialect, Gathered, On, Row, SqlDb, SqlHandle, SqlOptions, SqlStore, Stmt, TableName,
    bind, dialect_sql, handled_by, migrate, open_error,
};
use crate::error::{IdemError, StoreError};
use batch::{BatchSql, OwnedArg, Work, Writes, is_script, rows};

/// The operations table as idem creates it on SQLite, with the default table name.
///
/// For teams that run their own DDL (`migrate(false)`). The statements are idempotent
/// but for one: SQLite cannot add a column only if it is missing, so the `ALTER TABLE`
/// that adds `steps` fails on a table that has it (idem's own migrations skip it there).
pub const SQLITE_SCHEMA_SQL: &str = concat!(
    include_str!("../../../migrations/sqlite/0001_create_operations.sql"),
    "\n",
    include_str!("../../../migrations/sqlite/0002_epochs_and_key_mode.sql"),
    "\n",
    include_str!("../../../migrations/sqlite/0003_steps.sql"),
);

/// The migrations, in order: (version, DDL in the default table name).
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/sqlite/0001_create_operations.sql"),
    ),
    (
        2,
        include_str!("../../../migrations/sqlite/0002_epochs_and_key_mode.sql"),
    ),
    (3, include_str!("../../../migrations/sqlite/0003_steps.sql")),
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
    writes: Writes,
}

impl Sqlite {
    /// The dialect that only migrates, before the store's statements exist: its writes
    /// gather, but no claim or record comes through it.
    fn new(pool: SqlitePool) -> Sqlite {
        Sqlite {
            writes: Writes::new(pool.clone(), None),
            pool,
        }
    }

    /// The dialect for the store on `table`: its claims and records gather.
    fn for_table(pool: SqlitePool, table: &TableName) -> Sqlite {
        let r = |name| Stmt::render::<Sqlite>(name, table);
        let sql = BatchSql {
            claim: r(Sqlite::sql(engine::Sql::Claim)),
            record: r(Sqlite::sql(engine::Sql::Record)),
            claim_batch: r(Self::batch_sql(engine::OptionalSql::ClaimBatch)),
            record_batch: r(Self::batch_sql(engine::OptionalSql::RecordBatch)),
        };
        Sqlite {
            writes: Writes::new(pool.clone(), Some(sql)),
            pool,
        }
    }

    /// A batch statement, which SQLite's [`dialect_sql!`] call lists.
    fn batch_sql(name: engine::OptionalSql) -> &'static str {
        Sqlite::optional_sql(name).expect("SQLite lists its batch statements")
    }
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

    handled_by!(Sqlite);
    const NOW: &'static str = NOW_MS;
    const NEXT_EPOCH: &'static str = "(SELECT last_epoch + 1 FROM {meta} WHERE id = 0)";
    const SCHEMA: &'static str = "SQLITE_SCHEMA_SQL";

    const CLAIM_TOKEN: bool = true;

    dialect_sql!("sqlite", Peek, ClaimBatch, RecordBatch);

    fn placeholder(n: usize) -> String {
        format!("?{n}")
    }

    fn map_err(e: sqlx::Error) -> StoreError {
        engine::map_sqlx(e, retryable_code, unreachable_code)
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
                self.writes.write(work).await
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

    /// Always, on a store's dialect: SQLite has one writer, so every write waits for
    /// the batch before it anyway.
    fn gathers(&self) -> bool {
        self.writes.gathers()
    }

    async fn gathered(&self, op: Gathered) -> Option<Result<Vec<Row>, sqlx::Error>> {
        Some(self.writes.write(Work::Op(op)).await)
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
    use crate::store::test_support::*;
    use crate::store::{Admin, Claim, Fence, Store};

    pub(super) async fn memory() -> SqliteStore {
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
            include_str!("../../../migrations/sqlite/0001_create_operations.sql"),
            include_str!("../../../migrations/sqlite/0002_epochs_and_key_mode.sql"),
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
    pub(super) struct TempDb(pub(super) std::path::PathBuf);

    impl TempDb {
        pub(super) fn new(name: &str) -> TempDb {
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

    #[test]
    fn busy_and_locked_are_retryable() {
        assert!(retryable_code("5") && retryable_code("517") && retryable_code("6"));
        assert!(!retryable_code("19") && !retryable_code("2067") && !retryable_code("1"));
    }

    #[test]
    fn long_table_names_keep_index_suffixes() {
        let long = TableName::parse(&"t".repeat(63), false).unwrap();
        let sql = long.render_ddl(SQLITE_SCHEMA_SQL);
        let purge = format!("\"{}_purge_idx\"", "t".repeat(53));
        assert!(sql.contains(&purge), "{sql}");
        let trigger = format!("\"{}_steps_del\"", "t".repeat(53));
        assert!(sql.contains(&trigger), "{sql}");
        assert!(!sql.contains("idem_operations"), "{sql}");
    }

    #[test]
    fn every_statement_renders() {
        let table = TableName::parse("ops", false).unwrap();
        assert!(crate::store::engine::render_all::<Sqlite>(&table).len() > engine::Sql::ALL.len());
    }
}
