//! The MySQL / MariaDB dialect: one InnoDB table, leases by the database's clock.
//!
//! Times are unix milliseconds from `UTC_TIMESTAMP(3)`, which MySQL fixes for the whole
//! statement and which no session time zone or daylight-saving change can shift.
//!
//! MySQL has no `RETURNING` on an upsert, so a statement file may hold several
//! statements, one per line-ending `;`, run in order on one connection: inside their
//! own transaction on the store's pool, or inside the caller's transaction in
//! transactional mode. The result is the last one's rows if it is a `SELECT`, else a row
//! `held` with the number of rows all of them matched (sqlx sets `CLIENT_FOUND_ROWS`, so
//! an update that rewrites a value with itself still counts): a fenced write of several
//! statements (a step's record) guards each by the fence, and holds if any matched. The
//! purge, run for its count, is the exception: each of its statements stands alone, and
//! the last one's count is what it deleted; so is a file of alternatives (a release,
//! a retry's resolve), each tried alone until one matches.
//!
//! On the pool, a file of several statements is one round trip: `BEGIN`, the
//! statements with their arguments written in as hex and decimal literals, and
//! `COMMIT`, sent as one multi-statement query ([`Batch`]; sqlx sets
//! `CLIENT_MULTI_STATEMENTS`). The server runs them in order and stops at the first that
//! fails; the transaction that leaves open is rolled back before the connection goes
//! back to the pool (or the connection is closed). In the caller's transaction the
//! statements go one by one, prepared.
//!
//! The claim is one prepared `CALL` of a stored procedure named after the table
//! (`<table>_claim_v2`, created by migration 4 from
//! `migrations/mysql/0004_claim_procedure_v2.sql`; migration 3's `<table>_claim` stays
//! for processes of the earlier version), which runs the claim's transaction on
//! the server (the upsert that decides, the epoch drawn only for a claim it made, the
//! locking read of what it decided) and answers with that row; `claim.sql` is the call.
//! Its row is read column by column with the names the server sends (sqlx's lookup by
//! name uses the prepared statement's columns, and a `CALL` has none). So a fresh call
//! is two round trips: the claim, then the record. The procedure begins and commits its
//! own transaction, so it is never called inside the caller's (transactional mode has
//! its own statements, `tx_*.sql`).
//!
//! # Connections
//!
//! Opened by `Idem::mysql` or `IdemBuilder::mysql`, one store (and every clone of its
//! `Idem`) holds one sqlx pool of up to `max_connections` (default 16) connections,
//! for everything; there is no listener (waiters poll). The pool pings a connection
//! before handing it out only when it sat idle for over a second. That is the whole
//! footprint; on an application's pool (`Idem::from_pool`) idem holds none of its own,
//! and transactional mode uses the caller's connection. Opening needs one free slot: a
//! server with none left refuses the open at once with its reason (error 1040, or 1203
//! for a user's `max_user_connections`) and the pool's size.
//!
//! # A read-only server
//!
//! A replica, or a primary being demoted in a failover (`read_only`,
//! `super_read_only`, `transaction_read_only`), refuses idem's writes with error 1290
//! ("running with the --read-only option"), 1836 ("running in read-only mode") or
//! 1792 ("cannot execute statement in a READ ONLY transaction"). Each is a retryable
//! store error, never an unreachable one: the body does not run, and `fail_open` does
//! not run it unprotected either (the server answered and holds the records); a record
//! is retried while its lease holds. Opening on a read-only server fails the same way,
//! as the open writes its bookkeeping. (`read_only` does not bind users with `SUPER`
//! or `READ_ONLY ADMIN`, so idem's writes as such a user still succeed there.)
//!
//! # Files
//!
//! This file holds the dialect, its migrations and its opening; beside it `run.rs`, how
//! a statement file runs on the wire (several statements, alternatives, one round trip
//! on the pool); `errors.rs`, which error numbers are retryable or unreachable;
//! `open.rs`, `Idem::mysql` and `IdemBuilder::mysql`.

mod errors;
mod open;
mod run;

use std::str::FromStr;

use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions};

use super::engine::{
    Arg, Dialect, On, Row, SqlDb, SqlHandle, SqlOptions, SqlStore, Stmt, TableName, bind,
    dialect_sql, handled_by, migrate, open_error,
};
use super::server::{Server, first_connection, pinged_when_idle, redact_url};
use crate::error::{IdemError, StoreError};
pub(crate) use errors::map_err;
use errors::{
    ER_CON_COUNT_ERROR, ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, ER_SP_DOES_NOT_EXIST,
    ER_TOO_MANY_USER_CONNECTIONS, error_number,
};
pub(crate) use run::parts_with_params;
use run::{Answering, Batch, alternatives, first_match, rolled_back, run, split, split_script};

/// The operations table, its epoch counter and meta table, and the claim's stored
/// procedure, as idem creates them on MySQL or MariaDB, with the default table name.
///
/// For teams that run their own DDL (`migrate(false)`); the statements are idempotent.
/// Send it whole (a multi-statement query, as `sqlx::raw_sql` does): the procedure's
/// body holds `;`s, which the `mysql` command-line client splits at unless told a
/// `DELIMITER`.
pub const MYSQL_SCHEMA_SQL: &str = concat!(
    include_str!("../../../migrations/mysql/0001_create_operations.sql"),
    "\n",
    include_str!("../../../migrations/mysql/0002_steps.sql"),
    "\n",
    include_str!("../../../migrations/mysql/0003_claim_procedure.sql"),
    "\n",
    include_str!("../../../migrations/mysql/0004_claim_procedure_v2.sql"),
);

/// The migrations, in order: (version, DDL in the default table name).
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/mysql/0001_create_operations.sql"),
    ),
    (2, include_str!("../../../migrations/mysql/0002_steps.sql")),
    (
        3,
        include_str!("../../../migrations/mysql/0003_claim_procedure.sql"),
    ),
    (
        4,
        include_str!("../../../migrations/mysql/0004_claim_procedure_v2.sql"),
    ),
];

/// The store's clock in unix milliseconds, fixed for the whole statement.
const NOW_MS: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(3)) DIV 1000)";

/// The named lock that serializes idem's migrations across processes.
const MIGRATION_LOCK: &str = "idem_migrations";

/// How long an open waits for another process's migrations, in seconds.
const MIGRATION_LOCK_WAIT_S: i64 = 60;

/// Connections `Idem::mysql` opens, unless the builder says otherwise.
const DEFAULT_MAX_CONNECTIONS: u32 = 16;

/// The MySQL dialect: a pool over one database.
#[derive(Debug)]
pub struct MySql {
    pub(crate) pool: MySqlPool,
}

/// The MySQL store.
pub(crate) type MySqlStore = SqlStore<MySql>;

impl SqlDb for sqlx::MySql {
    type Dialect = MySql;
}

#[async_trait::async_trait]
impl Dialect for MySql {
    type Db = sqlx::MySql;
    type Conn = MySqlConnection;

    handled_by!(MySql);
    const NOW: &'static str = NOW_MS;
    const NEXT_EPOCH: &'static str = "LAST_INSERT_ID()";
    const SCHEMA: &'static str = "MYSQL_SCHEMA_SQL";
    // Deadlocks and lock-wait timeouts between claims on one key roll the claim's own
    // transaction back, so issuing it again is safe.
    const CLAIM_ATTEMPTS: usize = 8;
    // The read is a round trip (and a pool acquire) of its own before the claim's
    // transaction: worth it while retries come in, not on every fresh call.
    const PEEK_WHILE_REPLAYING: bool = true;
    const NUMBERED_PLACEHOLDERS: bool = false;

    const CLAIM_TOKEN: bool = true;

    dialect_sql!("mysql", Peek);

    fn placeholder(_: usize) -> String {
        "?".to_owned()
    }

    fn map_err(e: sqlx::Error) -> StoreError {
        map_err(e)
    }

    fn is_conflict(e: &sqlx::Error) -> bool {
        error_number(e).is_some_and(|n| matches!(n, ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT))
    }

    async fn fetch(
        &self,
        on: On<'_, MySqlConnection>,
        stmt: &Stmt,
        args: Vec<Arg<'_>>,
    ) -> Result<Vec<Row>, sqlx::Error> {
        if let Some(alternatives) = alternatives(&stmt.sql) {
            return match on {
                On::Conn(conn) => first_match(conn, &alternatives, args).await,
                On::Pool | On::Hot => {
                    let mut conn = Answering::acquire(&self.pool).await?;
                    let rows = first_match(conn.get(), &alternatives, args).await;
                    conn.answered();
                    rows
                }
            };
        }
        let parts = split(&stmt.sql);
        match on {
            On::Conn(conn) => run(conn, &parts, args).await,
            On::Pool | On::Hot if parts.len() == 1 => {
                let mut conn = Answering::acquire(&self.pool).await?;
                let rows = run(conn.get(), &parts, args).await;
                conn.answered();
                rows
            }
            On::Pool | On::Hot => {
                let mut conn = Answering::acquire(&self.pool).await?;
                let rows = match Batch::new(&parts, &args) {
                    Some(batch) => {
                        let rows = batch.run(conn.get()).await;
                        if rows.is_err() && !rolled_back(conn.get()).await {
                            // Dropped unanswered: closed, which rolls back what is open.
                            return rows;
                        }
                        rows
                    }
                    None => {
                        async {
                            let mut tx = sqlx::Connection::begin(conn.get()).await?;
                            let rows = run(&mut tx, &parts, args).await?;
                            tx.commit().await?;
                            Ok(rows)
                        }
                        .await
                    }
                };
                conn.answered();
                rows
            }
        }
    }

    /// A named lock (`GET_LOCK`), held by the migration's own connection: processes
    /// opening at once migrate one after another. DDL commits implicitly on MySQL, so the
    /// lock, not the transaction, is what serializes them; the connection is closed
    /// afterwards instead of returned to the pool, which releases the lock.
    async fn begin_migrations(
        &self,
        _: &TableName,
    ) -> Result<sqlx::Transaction<'static, sqlx::MySql>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        conn.close_on_drop();
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATION_LOCK)
            .bind(MIGRATION_LOCK_WAIT_S)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Err(sqlx::Error::Protocol(format!(
                "another process held the lock `{MIGRATION_LOCK}` for {MIGRATION_LOCK_WAIT_S}s \
                 while migrating idem tables"
            )));
        }
        sqlx::Transaction::begin(conn, None).await
    }

    async fn run_script(&self, conn: &mut MySqlConnection, sql: &str) -> Result<(), sqlx::Error> {
        for part in split_script(sql) {
            conn.execute(sqlx::raw_sql(part)).await?;
        }
        Ok(())
    }

    async fn execute(&self, stmt: &Stmt, args: Vec<Arg<'_>>) -> Result<u64, sqlx::Error> {
        let mut conn = Answering::acquire(&self.pool).await?;
        let mut args = args.into_iter();
        let mut done = Ok(0);
        for part in split(&stmt.sql) {
            let n = part.matches('?').count();
            let query = bind(sqlx::query(part), args.by_ref().take(n).collect());
            done = query.execute(conn.get()).await.map(|d| d.rows_affected());
            if done.is_err() {
                break;
            }
        }
        conn.answered();
        done
    }

    async fn from_pool(pool: MySqlPool, opts: &SqlOptions) -> Result<MySqlStore, IdemError> {
        from_pool(pool, opts).await
    }

    /// Whether `conn` is outside any transaction: so it is once the server rolled the
    /// caller's transaction back whole (InnoDB does on a deadlock, and on a lock-wait
    /// timeout under `innodb_rollback_on_timeout`). Outside a transaction MySQL accepts
    /// `SAVEPOINT` and forgets it at once, so releasing it fails with "does not exist";
    /// inside one both succeed.
    async fn transaction_gone(&self, conn: &mut MySqlConnection) -> bool {
        if conn
            .execute(sqlx::raw_sql("SAVEPOINT idem_probe"))
            .await
            .is_err()
        {
            return false;
        }
        match conn
            .execute(sqlx::raw_sql("RELEASE SAVEPOINT idem_probe"))
            .await
        {
            Ok(_) => false,
            Err(e) => error_number(&e) == Some(ER_SP_DOES_NOT_EXIST),
        }
    }
}

/// Connects to `url` and opens the idem table there, creating it unless `opts.migrate`
/// is false.
pub(crate) async fn open(url: &str, opts: &SqlOptions) -> Result<MySqlStore, IdemError> {
    let table = TableName::parse(&opts.table, false)?.backticked();
    let shown = redact_url(url);
    let connect = MySqlConnectOptions::from_str(url).map_err(|e| IdemError::Config {
        message: format!(
            "invalid MySQL URL `{shown}`: {e}; expected `mysql://user:password@host:port/database`"
        ),
    })?;
    let connect = match &opts.root_cert {
        Some(pem) => connect.ssl_ca_from_pem(pem.clone()),
        None => connect,
    };
    let size = opts.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
    let server = Server {
        db: "MySQL",
        shown: &shown,
        at: match connect.get_socket() {
            Some(socket) => socket.display().to_string(),
            None => format!("{}:{}", connect.get_host(), connect.get_port()),
        },
        map_err,
        is_full: |e| {
            error_number(e)
                .is_some_and(|n| matches!(n, ER_CON_COUNT_ERROR | ER_TOO_MANY_USER_CONNECTIONS))
        },
        footprint: format!("idem holds a pool of up to {size} connections to this server"),
        tls_params: ("ssl-mode", "ssl-ca"),
    };
    let first = first_connection(&server, &connect).await?;
    let _ = sqlx::Connection::close(first).await;
    let pool =
        pinged_when_idle(MySqlPoolOptions::new().max_connections(size)).connect_lazy_with(connect);
    prepare(pool, table, opts).await
}

/// Uses an application's pool; creates the idem table unless `opts.migrate` is false.
pub(crate) async fn from_pool(pool: MySqlPool, opts: &SqlOptions) -> Result<MySqlStore, IdemError> {
    let table = TableName::parse(&opts.table, false)?.backticked();
    prepare(pool, table, opts).await
}

/// Whether an SQL mode has MariaDB's `SIMULTANEOUS_ASSIGNMENT`, under which an update's
/// assignments all see the row as it was, which the claim's upsert does not expect.
fn simultaneous(mode: &str) -> bool {
    mode.to_ascii_uppercase()
        .contains("SIMULTANEOUS_ASSIGNMENT")
}

async fn prepare(
    pool: MySqlPool,
    table: TableName,
    opts: &SqlOptions,
) -> Result<MySqlStore, IdemError> {
    let mode: Option<String> = sqlx::query_scalar("SELECT CAST(@@SESSION.sql_mode AS CHAR)")
        .fetch_one(&pool)
        .await
        .map_err(|e| open_error::<MySql>(e, "cannot read the SQL mode".to_owned()))?;
    if mode.is_some_and(|m| simultaneous(&m)) {
        return Err(IdemError::Config {
            message: "the MySQL session runs with `SIMULTANEOUS_ASSIGNMENT`, under which \
                      idem's claim cannot decide in one upsert; remove it from `sql_mode`"
                .to_owned(),
        });
    }
    if opts.migrate {
        let migrator = MySql { pool: pool.clone() };
        migrate(&migrator, &table, MIGRATIONS).await.map_err(|e| {
            open_error::<MySql>(
                e,
                format!(
                    "cannot create the idem table `{table}`; grant CREATE and CREATE ROUTINE \
                     on the database, or create it yourself with `MYSQL_SCHEMA_SQL` and \
                     disable migrate"
                ),
            )
        })?;
    }
    let store = SqlStore::prepare(MySql { pool }, &table, &opts.key_mode).await?;
    let procedure = table.render("{claim_procedure}", NOW_MS);
    // A stored procedure runs in the SQL mode in force where it was defined, whatever
    // mode the caller's connection has.
    let found: Option<String> = sqlx::query_scalar(
        "SELECT CAST(sql_mode AS CHAR) FROM information_schema.routines \
         WHERE routine_schema = DATABASE() AND routine_type = 'PROCEDURE' \
           AND routine_name = TRIM(BOTH '`' FROM ?)",
    )
    .bind(&procedure)
    .fetch_optional(&store.dialect.pool)
    .await
    .map_err(|e| open_error::<MySql>(e, format!("cannot look up {procedure}")))?;
    if found.as_ref().is_some_and(|m| simultaneous(m)) {
        return Err(IdemError::Config {
            message: format!(
                "the idem claim procedure {procedure} was created under the SQL mode \
                 `SIMULTANEOUS_ASSIGNMENT`, under which it cannot decide in one upsert; drop \
                 it and create it again without that mode"
            ),
        });
    }
    if found.is_none() {
        return Err(IdemError::Config {
            message: format!(
                "the idem table `{table}` has no claim procedure {procedure}; create it with \
                 `idem_runtime::schema::MYSQL_SCHEMA_SQL` (renamed to `{table}`) or enable \
                 migrate (which needs the CREATE ROUTINE privilege)"
            ),
        });
    }
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// connections; `None` (skip) when it cannot be reached, unless `IDEM_REQUIRE_DB=1`.
    async fn open_test_store(label: &str, size: Option<u32>) -> Option<(MySqlStore, String)> {
        let url = test_url();
        let required = std::env::var("IDEM_REQUIRE_DB").as_deref() == Ok("1");
        let table = format!("idem_t_{label}_{}", std::process::id());
        let opts = SqlOptions {
            table: table.clone(),
            max_connections: size,
            ..SqlOptions::default()
        };
        match open(&url, &opts).await {
            Ok(store) => Some((store, table)),
            Err(e) if !required => {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "skipping: no MySQL: {e}");
                None
            }
            Err(e) => panic!("MySQL not reachable and IDEM_REQUIRE_DB=1: {e}"),
        }
    }

    /// `IDEM_MYSQL_URL`, or the local server.
    fn test_url() -> String {
        std::env::var("IDEM_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
    }

    async fn drop_test_tables(store: &MySqlStore, table: &str) {
        let pool = store.dialect.pool.clone();
        for suffix in ["", "_meta", "_epoch_seq", "_steps"] {
            let drop = format!("DROP TABLE IF EXISTS `{table}{suffix}`");
            pool.execute(drop.as_str()).await.unwrap();
        }
        for procedure in ["claim", "claim_v2"] {
            let drop = format!("DROP PROCEDURE IF EXISTS `{table}_{procedure}`");
            pool.execute(drop.as_str()).await.unwrap();
        }
        sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = ?")
            .bind(table)
            .execute(&pool)
            .await
            .unwrap();
    }

    /// A TCP proxy to `to` on a port of its own, counting the commands clients send
    /// through it (the packets that start a command: sequence number 0), each one round
    /// trip, except pings.
    async fn counting_proxy(to: String) -> (u16, std::sync::Arc<std::sync::atomic::AtomicU64>) {
        use std::sync::atomic::{AtomicU64, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let commands = std::sync::Arc::new(AtomicU64::new(0));
        let counted = commands.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&to).await.unwrap();
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
                let counted = counted.clone();
                tokio::spawn(async move {
                    let (mut buf, mut chunk) = (Vec::new(), vec![0u8; 1 << 16]);
                    loop {
                        let n = match from_client.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        // Counted before it is forwarded: once the server can answer,
                        // the caller may read the count.
                        buf.extend_from_slice(&chunk[..n]);
                        while buf.len() >= 4 {
                            let len = usize::from(buf[0])
                                | usize::from(buf[1]) << 8
                                | usize::from(buf[2]) << 16;
                            if buf.len() < 4 + len {
                                break;
                            }
                            // sqlx's ping as it returns a connection to the pool, after
                            // the caller has its answer, is not counted.
                            if buf[3] == 0 && buf.get(4) != Some(&COM_PING) {
                                counted.fetch_add(1, Ordering::SeqCst);
                            }
                            buf.drain(..4 + len);
                        }
                        if to_server.write_all(&chunk[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (port, commands)
    }

    const COM_PING: u8 = 0x0e;

    /// A fresh call is two round trips: the claim's transaction as one batch, then the
    /// record. Counted on the wire, on the store's only connection (no ping on acquire).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fresh_call_is_two_round_trips() {
        use crate::store::{Claim, ClaimRequest, Fence, OperationId, Store, StoredOutcome};
        use std::sync::atomic::Ordering;
        // Opened the usual way first, so that a server that is down skips or fails here.
        let Some((store, table)) = open_test_store("round_trips", Some(1)).await else {
            return;
        };
        let url = test_url();
        let connect = MySqlConnectOptions::from_str(&url).unwrap();
        let at = format!("{}:{}", connect.get_host(), connect.get_port());
        let (port, commands) = counting_proxy(at).await;
        let pool = MySqlPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(connect.host("127.0.0.1").port(port))
            .await
            .unwrap();
        let opts = SqlOptions {
            table: table.clone(),
            ..SqlOptions::default()
        };
        let counted = from_pool(pool, &opts).await.unwrap();
        let call = |n: u32| {
            let store = &counted;
            async move {
                let id = OperationId {
                    scope: String::new(),
                    name: "round-trips".into(),
                    key: format!("k{n}"),
                };
                let req = ClaimRequest {
                    id: &id,
                    fingerprint: [7; 32],
                    lease: std::time::Duration::from_secs(60),
                    on_takeover: crate::store::Takeover::Rerun,
                };
                let Claim::Acquired { epoch, .. } = store.claim(&req).await.unwrap() else {
                    panic!("a fresh key is claimed");
                };
                let outcome = StoredOutcome {
                    is_err: false,
                    version: 1,
                    body: b"1".to_vec().into(),
                };
                let retain = std::time::Duration::from_secs(60);
                let fence = store.record(&id, epoch, &outcome, retain).await.unwrap();
                assert_eq!(fence, Fence::Held);
            }
        };
        // The record's statement prepared on the connection before counting.
        call(0).await;
        let before = commands.load(Ordering::SeqCst);
        for n in 1..=100 {
            call(n).await;
        }
        let sent = commands.load(Ordering::SeqCst) - before;
        counted.dialect.pool.close().await;
        drop_test_tables(&store, &table).await;
        assert_eq!(sent, 200, "round trips of 100 fresh calls");
    }

    /// A table of an earlier version (migrations 1 and 2, no procedure) gains the
    /// procedures on open, once; opened with `migrate(false)`, it is a clear error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_earlier_table_gains_the_claim_procedure() {
        let Some((store, table)) = open_test_store("earlier", None).await else {
            return;
        };
        let pool = store.dialect.pool.clone();
        let url = test_url();
        let versions = || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM idem_schema_migrations WHERE table_name = ?",
            )
            .bind(&table)
            .fetch_one(&pool)
            .await
            .unwrap();
            n
        };
        assert_eq!(versions().await, 4);
        // As an earlier version of idem left it.
        sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = ? AND version >= 3")
            .bind(&table)
            .execute(&pool)
            .await
            .unwrap();
        for procedure in ["claim", "claim_v2"] {
            let forget = format!("DROP PROCEDURE `{table}_{procedure}`");
            pool.execute(forget.as_str()).await.unwrap();
        }
        let unmigrated = SqlOptions {
            table: table.clone(),
            migrate: false,
            ..SqlOptions::default()
        };
        match open(&url, &unmigrated).await {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("MYSQL_SCHEMA_SQL"), "{message}");
                assert!(message.contains("claim procedure"), "{message}");
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
        let opts = SqlOptions {
            table: table.clone(),
            ..SqlOptions::default()
        };
        for _ in 0..2 {
            let again = open(&url, &opts).await.unwrap();
            assert_eq!(versions().await, 4);
            drop(again);
        }
        open(&url, &unmigrated).await.unwrap();
        drop_test_tables(&store, &table).await;
    }

    #[test]
    fn every_statement_renders() {
        let table = TableName::parse("ops", false).unwrap().backticked();
        assert!(
            crate::store::engine::render_all::<MySql>(&table).len()
                > crate::store::engine::Sql::ALL.len()
        );
    }
}
