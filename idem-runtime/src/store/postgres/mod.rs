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
//!
//! # Files
//!
//! This file holds the dialect, its migrations and its opening; beside it `conns.rs`,
//! the connections idem holds for claims and records; `batch.rs`, group commit;
//! `listen.rs`, the `LISTEN` task that wakes this process's waiters; `errors.rs`, which
//! SQLSTATEs are retryable or unreachable; `open.rs`, `Idem::postgres` and
//! `IdemBuilder::postgres`.

mod batch;
mod conns;
mod errors;
mod listen;
mod open;
#[cfg(test)]
mod test_db;

use std::str::FromStr;
use std::sync::{Arc, Mutex};

use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

use super::engine::values::decode_row;
use super::engine::{
    Arg, Dialect, Gathered, On, OptionalSql, Row, Sql, SqlDb, SqlHandle, SqlOptions, SqlStore,
    Stmt, TableName, bind, dialect_sql, handled_by, migrate, open_error,
};
use super::group::Gather;
use super::server::{Server, first_connection, pinged_when_idle, redact_url};
use crate::error::{IdemError, StoreError};
use crate::store::WakeHub;
use batch::{GROUP_WRITERS, PgGroup, Waiting, write_batch};
use conns::{Conns, hot};
use errors::TOO_MANY_CONNECTIONS;
pub(crate) use errors::map_err;
use listen::Listener;

/// The operations table as idem creates it on PostgreSQL, with the default table name.
///
/// For teams that run their own DDL (`migrate(false)`); the statements are idempotent.
pub const POSTGRES_SCHEMA_SQL: &str = concat!(
    include_str!("../../../migrations/postgres/0001_create_operations.sql"),
    "\n",
    include_str!("../../../migrations/postgres/0002_epochs_and_key_mode.sql"),
    "\n",
    include_str!("../../../migrations/postgres/0003_steps.sql"),
    "\n",
    include_str!("../../../migrations/postgres/0004_released_expiry.sql"),
    "\n",
    include_str!("../../../migrations/postgres/0005_claim_limits.sql"),
);

/// The migrations, in order: (version, DDL in the default table name). Each is
/// idempotent, so a table created by hand from [`POSTGRES_SCHEMA_SQL`] can be adopted.
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/postgres/0001_create_operations.sql"),
    ),
    (
        2,
        include_str!("../../../migrations/postgres/0002_epochs_and_key_mode.sql"),
    ),
    (
        3,
        include_str!("../../../migrations/postgres/0003_steps.sql"),
    ),
    (
        4,
        include_str!("../../../migrations/postgres/0004_released_expiry.sql"),
    ),
    (
        5,
        include_str!("../../../migrations/postgres/0005_claim_limits.sql"),
    ),
];

/// The advisory lock that serializes idem's migrations across processes ("idemmigr").
const MIGRATION_LOCK: i64 = 0x6964_656d_6d69_6772;

/// Connections `Idem::postgres` holds for claims and records, unless the builder says
/// otherwise.
const DEFAULT_MAX_CONNECTIONS: u32 = 16;

/// Connections of the sqlx pool beside idem's own, for what is not on the hot path.
const ADMIN_CONNECTIONS: u32 = 4;

/// The connections [`open()`] holds at most, with `hot` for claims and records, in words.
fn footprint(hot: u32) -> String {
    format!(
        "idem holds up to {} connections to this server ({hot} for claims and records, set \
         by `max_connections`; {ADMIN_CONNECTIONS} for migrations and operations queries; 1 \
         listening for wake-ups)",
        hot + ADMIN_CONNECTIONS + 1
    )
}

const LOCK_MIGRATIONS: &str = "SELECT pg_advisory_xact_lock($1)";

/// The PostgreSQL dialect: a pool, idem's own connections when it opened the database,
/// and (once wakers are attached) a background `LISTEN` task that stops with the store.
#[derive(Debug)]
pub struct Pg {
    pub(crate) pool: PgPool,
    /// The claim's and the record's connections, when idem opened the database itself.
    owned: Option<Arc<Conns>>,
    /// Group commit of claims and records (none on the migrations' dialect).
    group: Option<Arc<PgGroup>>,
    listener: Mutex<Option<Listener>>,
}

/// The PostgreSQL store.
pub(crate) type PgStore = SqlStore<Pg>;

impl SqlDb for sqlx::Postgres {
    type Dialect = Pg;
}

#[async_trait::async_trait]
impl Dialect for Pg {
    type Db = sqlx::Postgres;
    type Conn = PgConnection;

    handled_by!(Postgres);
    const NOW: &'static str = "clock_timestamp()";
    const NEXT_EPOCH: &'static str = "nextval('{epoch_seq}')";
    const SCHEMA: &'static str = "POSTGRES_SCHEMA_SQL";
    const CLAIM_ATTEMPTS: usize = 5;
    // The claim answers a replay in its one statement too, but a plain primary-key read
    // is lighter; fresh calls skip it.
    const PEEK_WHILE_REPLAYING: bool = true;
    const PEEK_ON_HOT: bool = true;

    dialect_sql!(
        "postgres",
        AnnounceWait,
        Wake,
        Peek,
        ClaimBatch,
        ClaimFreshBatch,
        ClaimConflict,
        RecordBatch,
        PurgeLocked,
        ClaimFresh,
        TakeClaimToken,
        PurgeClaimTokens,
    );

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    fn map_err(e: sqlx::Error) -> StoreError {
        map_err(e)
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
        let task = Listener::spawn(&runtime, options, hub);
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
    let pool = pinged_when_idle(PgPoolOptions::new().max_connections(ADMIN_CONNECTIONS))
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
    let r = |sql| Stmt::render::<Pg>(sql, &table);
    let optional = |name| r(Pg::optional_sql(name).expect("PostgreSQL lists it"));
    let group = PgGroup {
        pool: pool.clone(),
        owned: owned.clone(),
        claim_fresh: optional(OptionalSql::ClaimFresh),
        claim: r(Pg::sql(Sql::Claim)),
        claim_fresh_batch: optional(OptionalSql::ClaimFreshBatch),
        record: r(Pg::sql(Sql::Record)),
        claim_batch: optional(OptionalSql::ClaimBatch),
        record_batch: optional(OptionalSql::RecordBatch),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_support::*;
    use crate::store::{Claim, Store};
    use test_db::{TestDb, drop_table, url};

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

    #[test]
    fn schema_qualified_ddl_is_renamed_with_its_indexes() {
        let t = TableName::parse("app.jobs", true).unwrap();
        assert_eq!(t.schema(), Some("app"));
        let sql = t.render_ddl(POSTGRES_SCHEMA_SQL);
        assert!(!sql.contains("idem_operations"), "{sql}");
        assert!(
            sql.contains("INDEX IF NOT EXISTS \"jobs_purge_idx\""),
            "{sql}"
        );
        assert!(sql.contains("ON \"app\".\"jobs\" (expires_at)"), "{sql}");
        assert!(
            sql.contains("CREATE TABLE IF NOT EXISTS \"app\".\"jobs_steps\""),
            "{sql}"
        );
    }

    #[test]
    fn every_statement_renders() {
        let table = TableName::parse("app.ops", true).unwrap();
        assert!(crate::store::engine::render_all::<Pg>(&table).len() > Sql::ALL.len());
    }
}
