//! Transactional mode: the claim and the record commit or roll back with the caller's
//! own writes. The checks are `idem_runtime::store::conformance::tx`, written once;
//! this file opens each database for them: a schema (SQLite: a file) of its own per
//! test, holding the business table `orders` and idem's table.
use crate::common;
// The server databases' skips, URLs and names.
#[cfg(any(feature = "postgres", feature = "mysql"))]
use common::*;
use idem_runtime::Idem;
use idem_runtime::store::conformance::tx::{TxDatabase, TxTarget};

/// One database opened for one test, and what to drop once the test passed (a failed
/// test's schema stays for inspection).
struct Db<DB: TxDatabase> {
    target: TxTarget<DB>,
    /// Lazy: runs only when awaited, after the test.
    cleanup: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    _dir: Option<tempfile::TempDir>,
}

/// Instantiates every check of `conformance::tx` as a test of `$module`, on what `$open`
/// opens: the common list below, then the checks each database lists itself (one with a
/// known gap there, ignored with the reason). Each check appears once per database.
macro_rules! tx_conformance {
    ($module:ident, $open:path, [$($extra:tt)*]) => {
        tx_conformance!(@tests $module, $open, [
            tx_committed_once_then_replayed: committed_once_then_replayed,
            tx_released_error_keeps_neither_writes_nor_claim: released_error_keeps_neither_writes_nor_claim,
            tx_rolled_back_attempt_leaves_nothing: rolled_back_attempt_leaves_nothing,
            tx_mismatch_in_transaction: mismatch_in_transaction,
            tx_a_claim_the_body_rolled_back_is_refused: a_claim_the_body_rolled_back_is_refused,
            tx_a_record_is_fenced_by_its_claims_epoch: a_record_is_fenced_by_its_claims_epoch,
            tx_a_second_claim_in_the_same_transaction_is_in_flight: a_second_claim_in_the_same_transaction_is_in_flight,
            tx_nested_operations_in_one_transaction_each_record: nested_operations_in_one_transaction_each_record,
            tx_current_is_set_in_a_transactional_body: current_is_set_in_a_transactional_body,
            tx_a_duplicate_waits_for_the_first_transaction: a_duplicate_waits_for_the_first_transaction,
            tx_a_duplicate_from_an_older_snapshot_retries_or_replays: a_duplicate_from_an_older_snapshot_retries_or_replays,
            tx_concurrent_duplicates_write_once: concurrent_duplicates_write_once,
            tx_abandoned_claim_is_taken_over_after_its_lease: abandoned_claim_is_taken_over_after_its_lease,
            tx_recorded_error_after_the_body_sql_failed: recorded_error_after_the_body_sql_failed,
            tx_expired_outcome_is_claimed_afresh: expired_outcome_is_claimed_afresh,
            tx_unknown_is_answered_in_a_transaction: unknown_is_answered_in_a_transaction,
            tx_model_random_schedules: model_random_schedules,
            $($extra)*
        ]);
    };
    (@tests $module:ident, $open:path, [$($(#[$attr:meta])* $test:ident: $check:ident),* $(,)?]) => {
        mod $module {
            use idem_runtime::store::conformance::tx;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                $(#[$attr])*
                async fn $test() {
                    if let Some(db) = $open(stringify!($test)).await {
                        tx::$check(&db.target).await;
                        db.cleanup.await;
                    }
                }
            )*
        }
    };
}

/// A file database in WAL mode, waiting up to 30 s on another writer's lock.
async fn open_sqlite(_test: &str) -> Option<Db<sqlx::Sqlite>> {
    let dir = tempfile::tempdir().unwrap();
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("app.db"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(std::time::Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(opts)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let idem = Idem::from_pool(pool.clone()).await.unwrap();
    // SQLite has no row locks: take the write lock up front so a duplicate waits on it.
    // A deferred `BEGIN` (the default) reads from a snapshot until it writes.
    let target = TxTarget::new(pool, idem, "orders")
        .begin_with(|pool| async move { pool.begin_with("BEGIN IMMEDIATE").await });
    Some(Db {
        target,
        cleanup: Box::pin(async {}),
        _dir: Some(dir),
    })
}

tx_conformance!(sqlite, super::open_sqlite, []);

#[cfg(feature = "postgres")]
async fn open_pg(test: &str) -> Option<Db<sqlx::Postgres>> {
    postgres_skip(test).is_none().then_some(())?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&postgres_url())
        .await;
    let pool = reached_or_skip(test, "PostgreSQL", &postgres_url(), pool)?;
    let schema = unique_table(test);
    for stmt in [
        format!("CREATE SCHEMA {schema}"),
        format!("CREATE TABLE {schema}.orders (id TEXT PRIMARY KEY, qty BIGINT NOT NULL)"),
    ] {
        sqlx::query(&stmt).execute(&pool).await.unwrap();
    }
    let idem = Idem::builder()
        .table(format!("{schema}.idem_operations"))
        .pool(pool.clone())
        .await
        .unwrap();
    // The default READ COMMITTED waits on the row; REPEATABLE READ keeps its snapshot.
    let cleanup = {
        let (pool, schema) = (pool.clone(), schema.clone());
        Box::pin(async move { drop_schema(&pool, &schema).await })
    };
    let target = TxTarget::new(pool, idem, format!("{schema}.orders")).begin_snapshot_with(
        |pool| async move {
            pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ")
                .await
        },
    );
    Some(Db {
        target,
        cleanup,
        _dir: None,
    })
}

#[cfg(feature = "postgres")]
tx_conformance!(postgres, super::open_pg, []);

/// A database of its own for each MySQL test, holding the business table and idem's
/// (default name), reached through a pool whose connections use it.
#[cfg(feature = "mysql")]
async fn open_mysql(test: &str) -> Option<Db<sqlx::MySql>> {
    use std::str::FromStr;
    mysql_skip(test).is_none().then_some(())?;
    let admin = sqlx::MySqlPool::connect(&mysql_url()).await;
    let admin = reached_or_skip(test, "MySQL", &mysql_url(), admin)?;
    let db = unique_table(test);
    for stmt in [
        format!("CREATE DATABASE {db}"),
        format!("CREATE TABLE {db}.orders (id VARCHAR(64) PRIMARY KEY, qty BIGINT NOT NULL)"),
    ] {
        sqlx::query(&stmt).execute(&admin).await.unwrap();
    }
    admin.close().await;
    let opts = sqlx::mysql::MySqlConnectOptions::from_str(&mysql_url())
        .unwrap()
        .database(&db);
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(20)
        .connect_with(opts)
        .await
        .unwrap();
    let idem = Idem::from_pool(pool.clone()).await.unwrap();
    // InnoDB's default REPEATABLE READ is the snapshot the checks need.
    let cleanup = {
        let (pool, db) = (pool.clone(), db.clone());
        Box::pin(async move {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db}"))
                .execute(&pool)
                .await;
        })
    };
    let target = TxTarget::new(pool, idem, format!("{db}.orders"))
        .cancellable_with(begin_mysql_closing, close_mysql);
    Some(Db {
        target,
        cleanup,
        _dir: None,
    })
}

/// A transaction on a connection that is closed, not returned to the pool, when the
/// transaction is dropped: sqlx's MySQL driver cannot resume a connection whose query
/// future was dropped mid-flight (a later statement on it can wait forever for a reply,
/// or read another's), so a cancelled call's connection is closed, which makes the server
/// roll its transaction back.
#[cfg(feature = "mysql")]
async fn begin_mysql_closing(
    pool: sqlx::MySqlPool,
) -> Result<sqlx::Transaction<'static, sqlx::MySql>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    conn.close_on_drop();
    sqlx::Transaction::begin(conn, None).await
}

/// Abandons a transaction whose call was cancelled: dropped, its connection closes.
#[cfg(feature = "mysql")]
async fn close_mysql(tx: sqlx::Transaction<'static, sqlx::MySql>) {
    drop(tx);
}

#[cfg(feature = "mysql")]
tx_conformance!(mysql, super::open_mysql, []);
