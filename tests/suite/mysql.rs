//! What is MySQL/MariaDB's own: two OS processes racing in transactional mode, a
//! lock-wait timeout surfacing as a retryable store error, processes opening at once
//! under the migrations' named lock, the shipped schema without migrations, a replay
//! that reads past a held row lock, and a transactional body that loses a deadlock.
#![cfg(feature = "mysql")]
use crate::common;
use common::*;
use idem_runtime::{Idem, IdemError, TxStep};
use std::str::FromStr;

/// A database of its own for `test`, and a pool on it; `None` (with one line saying
/// why) when MySQL is unreachable outside CI.
async fn database(test: &str) -> Option<(String, String, sqlx::MySqlPool)> {
    mysql_skip(test).is_none().then_some(())?;
    let admin = sqlx::MySqlPool::connect(&mysql_url()).await;
    let admin = reached_or_skip(test, "MySQL", &mysql_url(), admin)?;
    let db = unique_table(test);
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    let opts = sqlx::mysql::MySqlConnectOptions::from_str(&mysql_url())
        .unwrap()
        .database(&db);
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .connect_with(opts)
        .await
        .unwrap();
    // The URL of the same database, for the worker processes.
    let base = mysql_url();
    let url = match base.rsplit_once('/') {
        Some((server, _)) if server.contains("//") && !server.ends_with('/') => {
            format!("{server}/{db}")
        }
        _ => format!("{}/{db}", base.trim_end_matches('/')),
    };
    Some((db, url, pool))
}

/// A pool of `max` connections on `db` whose sessions wait `lock_wait_s` seconds for a
/// row lock, and whose acquires wait `acquire` for a free connection.
async fn pool_waiting_on_locks(
    db: &str,
    max: u32,
    lock_wait_s: u32,
    acquire: std::time::Duration,
) -> sqlx::MySqlPool {
    use sqlx::Executor;
    let opts = sqlx::mysql::MySqlConnectOptions::from_str(&mysql_url())
        .unwrap()
        .database(db);
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(acquire)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(
                    format!("SET SESSION innodb_lock_wait_timeout = {lock_wait_s}").as_str(),
                )
                .await
                .map(drop)
            })
        })
        .connect_with(opts)
        .await
        .unwrap()
}

async fn drop_database(pool: &sqlx::MySqlPool, db: &str) {
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db}"))
        .execute(pool)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_race_on_the_same_keys() {
    let Some((db, url, pool)) = database("mysql_two_processes").await else {
        return;
    };
    sqlx::query("CREATE TABLE effects (`key` BIGINT PRIMARY KEY, worker TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    // Create idem's table before the race, so both workers race on claims, not DDL.
    Idem::from_pool(pool.clone()).await.unwrap();
    const KEYS: u32 = 1_000;
    let ran = race_two_processes(&url, &db, KEYS).await;
    assert_eq!(ran, KEYS, "each key's body ran once in total");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, i64::from(KEYS));
    let completed: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_operations WHERE state = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(completed, i64::from(KEYS));
    drop_database(&pool, &db).await;
}

/// A duplicate that waits on the row lock past `innodb_lock_wait_timeout` (error 1205)
/// gets a retryable `Store` error; after the first commits, the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_timeout_is_a_retryable_store_error() {
    let Some((db, _url, pool)) = database("mysql_lock_wait").await else {
        return;
    };
    let idem = Idem::from_pool(pool.clone()).await.unwrap();
    let op = || {
        idem.operation("book", "seat-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
    };
    let mut first = pool.begin().await.unwrap();
    let guard = match op()
        .begin_tx::<_, u32, IdemError>(&mut first)
        .await
        .unwrap()
    {
        TxStep::Run(g) => g,
        TxStep::Replay(_) => panic!("fresh key"),
    };

    let mut second = pool.begin().await.unwrap();
    sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
        .execute(&mut *second)
        .await
        .unwrap();
    match op().begin_tx::<_, u32, IdemError>(&mut second).await {
        Err(e @ IdemError::Store { .. }) => assert!(e.is_retryable(), "{e}"),
        Err(e) => panic!("expected a retryable store error, got {e}"),
        Ok(_) => panic!("expected a retryable store error, got a claim or a replay"),
    }
    second.rollback().await.unwrap();

    assert_eq!(
        guard
            .finish(&mut first, Ok::<u32, IdemError>(7))
            .await
            .unwrap(),
        7
    );
    first.commit().await.unwrap();
    let mut again = pool.begin().await.unwrap();
    match op()
        .begin_tx::<_, u32, IdemError>(&mut again)
        .await
        .unwrap()
    {
        TxStep::Replay(out) => assert_eq!(out.unwrap(), 7),
        TxStep::Run(_) => panic!("ran again after the first committed"),
    }
    again.rollback().await.unwrap();
    drop_database(&pool, &db).await;
}

/// Once replays come in, a replay is one plain read that neither takes nor waits for the
/// record's row lock: with another transaction holding that lock, a retry of a completed
/// call replays. A claim that wrote would wait for the lock and fail (this pool's
/// sessions give up on a lock after one second). The replay cache is off, so every
/// replay reaches MySQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_reads_past_a_held_row_lock() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let Some((db, _url, pool)) = database("mysql_replay_lock").await else {
        return;
    };
    let impatient = pool_waiting_on_locks(&db, 2, 1, std::time::Duration::from_secs(30)).await;
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .pool(impatient)
        .await
        .unwrap();
    let runs = AtomicU32::new(0);
    let charge = || {
        idem.operation("charge", "c-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<u32, IdemError>(7)
            })
    };
    assert_eq!(charge().await.unwrap(), 7);
    // A first replay, decided by the claim: the store reads first only after replays.
    assert_eq!(charge().await.unwrap(), 7);

    let mut holder = pool.begin().await.unwrap();
    let locked = sqlx::query("SELECT state FROM idem_operations FOR UPDATE")
        .fetch_all(&mut *holder)
        .await
        .unwrap();
    assert_eq!(locked.len(), 1);
    match charge().await {
        Ok(out) => assert_eq!(out, 7),
        Err(e) => panic!("the replay waited for the row lock: {e}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran once");
    holder.rollback().await.unwrap();
    drop_database(&pool, &db).await;
}

/// Six stores opening one fresh table at once: the named lock lets one migrate and the
/// others find the work done, so every open succeeds and the migration is recorded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_opens_migrate_once() {
    let Some((db, url, pool)) = database("mysql_opens").await else {
        return;
    };
    let opens: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { Idem::builder().table("shared_ops").mysql(&url).await })
        })
        .collect();
    for open in opens {
        open.await.unwrap().expect("concurrent open");
    }
    let versions: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idem_schema_migrations WHERE table_name = 'shared_ops'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(versions, 4, "each of the four migrations once");
    drop_database(&pool, &db).await;
}

/// A table made by hand from `MYSQL_SCHEMA_SQL` works with `migrate(false)`; a missing
/// one is a configuration error that names the schema constant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_schema_works_without_migrate() {
    let Some((db, _url, pool)) = database("mysql_schema").await else {
        return;
    };
    match Idem::builder().migrate(false).pool(pool.clone()).await {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("MYSQL_SCHEMA_SQL"), "{message}")
        }
        other => panic!("expected Config, got {:?}", other.err()),
    }
    sqlx::raw_sql(idem_runtime::schema::MYSQL_SCHEMA_SQL)
        .execute(&pool)
        .await
        .unwrap();
    let idem = Idem::builder()
        .migrate(false)
        .pool(pool.clone())
        .await
        .unwrap();
    let runs = common::Counter::default();
    let day = std::time::Duration::from_secs(86_400);
    let run = || common::counted_call(&idem, "charge", "o-1", day, &runs, 42);
    assert_eq!(run().await.unwrap(), 42);
    assert_eq!(run().await.unwrap(), 42);
    assert_eq!(runs.get(), 1, "the replay ran the body");
    assert_eq!(idem.stats().await.unwrap().completed, 1);
    drop_database(&pool, &db).await;
}

/// Contention is not an outage: a leased call with `fail_open` whose claim keeps timing
/// out on a row lock (error 1205) gets a retryable `Store` error and does not run its
/// body while a transaction holds the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_does_not_run_on_a_lock_wait_timeout() {
    let Some((db, url, pool)) = database("mysql_fail_open_lock").await else {
        return;
    };
    let holder = Idem::from_pool(pool.clone()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let TxStep::Run(guard) = holder
        .operation("notify", "k")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .begin_tx::<_, u32, IdemError>(&mut tx)
        .await
        .unwrap()
    else {
        panic!("fresh key replayed");
    };
    // Another process whose lock waits give up after one second.
    let impatient = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect(&url)
        .await
        .unwrap();
    let other = Idem::builder()
        .migrate(false)
        .pool(impatient)
        .await
        .unwrap();
    let mut ran = false;
    let r = other
        .operation("notify", "k")
        .on_store_error(idem_runtime::OnStoreError::FailOpen)
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            ran = true;
            Ok::<_, IdemError>(1u32)
        })
        .await;
    match &r {
        Err(e @ IdemError::Store { .. }) => assert!(e.is_retryable(), "{e}"),
        other => panic!("expected a retryable store error, got {other:?}"),
    }
    assert!(
        !ran,
        "fail_open ran the body while a transaction held the claim"
    );
    drop(guard);
    tx.rollback().await.unwrap();
    drop_database(&pool, &db).await;
}

/// A body's error, recorded under `errors = record`: the database's refusal of its
/// statement, or idem's error (never recorded).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum BookError {
    Refused(String),
    #[serde(skip)]
    Idem(IdemError),
}

impl From<IdemError> for BookError {
    fn from(e: IdemError) -> Self {
        BookError::Idem(e)
    }
}

fn take(seat: u32) -> String {
    format!("UPDATE seats SET taken = taken + 1 WHERE id = {seat}")
}

/// Runs a body on `tx` whose statement is a deadlock's victim (1213): `tx` takes seat 1,
/// another transaction seat 2, then each wants the other's. The other's 200 inserted
/// rows make it the heavier, so InnoDB rolls back `tx`. Returns the body's result once
/// the other transaction has committed.
async fn lose_a_deadlock(
    pool: &sqlx::MySqlPool,
    tx: &mut sqlx::Transaction<'static, sqlx::MySql>,
) -> Result<u32, BookError> {
    let (ready_tx, ready) = tokio::sync::oneshot::channel::<()>();
    let (locked_tx, locked) = tokio::sync::oneshot::channel::<()>();
    let other = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(
                "INSERT INTO ballast (id) WITH RECURSIVE n (i) AS \
                 (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200) SELECT i FROM n",
            )
            .execute(&mut *tx)
            .await
            .unwrap();
            sqlx::query(&take(2)).execute(&mut *tx).await.unwrap();
            ready_tx.send(()).unwrap();
            locked.await.unwrap();
            sqlx::query(&take(1))
                .execute(&mut *tx)
                .await
                .expect("the heavier transaction was chosen as the victim");
            tx.commit().await.unwrap();
        }
    });
    ready.await.unwrap();
    sqlx::query(&take(1)).execute(&mut **tx).await.unwrap();
    locked_tx.send(()).unwrap();
    let out = sqlx::query(&take(2))
        .execute(&mut **tx)
        .await
        .map(|_| 2u32)
        .map_err(|e| BookError::Refused(e.to_string()));
    assert!(
        matches!(&out, Err(BookError::Refused(m)) if m.contains("1213")),
        "the body's statement was not the deadlock's victim: {out:?}"
    );
    other.await.unwrap();
    out
}

/// What the caller of a body that lost a deadlock must get: a retryable `Store` error
/// saying to retry the whole transaction, never a savepoint error.
fn assert_retry_whole(got: Result<u32, BookError>) {
    match got {
        Err(BookError::Idem(e @ IdemError::Store { .. })) => {
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("retry the whole transaction"), "{e}");
        }
        other => panic!("expected a retryable store error, got {other:?}"),
    }
}

/// A body whose statement is a deadlock's victim: InnoDB rolled the whole transaction
/// back, idem's savepoints and claim with it. Whether the error is recorded or
/// released, the caller is told to retry the whole transaction, and that retry runs the
/// body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_victim_is_told_to_retry_the_whole_transaction() {
    let Some((db, _url, pool)) = database("mysql_deadlock").await else {
        return;
    };
    for stmt in [
        "CREATE TABLE seats (id INT PRIMARY KEY, taken INT NOT NULL)",
        "INSERT INTO seats VALUES (1, 0), (2, 0)",
        "CREATE TABLE ballast (id INT NOT NULL)",
    ] {
        sqlx::query(stmt).execute(&pool).await.unwrap();
    }
    let idem = Idem::from_pool(pool.clone()).await.unwrap();
    let book = || {
        idem.operation("book", "seat-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
    };

    // `errors = record`: the error would be recorded, but the claim is gone.
    let mut tx = pool.begin().await.unwrap();
    let TxStep::Run(guard) = book()
        .record_errors()
        .begin_tx::<_, u32, BookError>(&mut tx)
        .await
        .unwrap()
    else {
        panic!("fresh key replayed");
    };
    let out = lose_a_deadlock(&pool, &mut tx).await;
    assert_retry_whole(guard.finish(&mut tx, out).await);
    drop(tx);

    // `errors = release`: the savepoint to roll back to is gone too.
    let mut tx = pool.begin().await.unwrap();
    let TxStep::Run(guard) = book().begin_tx::<_, u32, BookError>(&mut tx).await.unwrap() else {
        panic!("replayed a call whose transaction was rolled back");
    };
    let out = lose_a_deadlock(&pool, &mut tx).await;
    assert_retry_whole(guard.finish(&mut tx, out).await);
    drop(tx);

    // Nothing was recorded: the retry of the whole transaction runs the body.
    let mut tx = pool.begin().await.unwrap();
    let TxStep::Run(guard) = book()
        .record_errors()
        .begin_tx::<_, u32, BookError>(&mut tx)
        .await
        .unwrap()
    else {
        panic!("replayed a call whose transaction was rolled back");
    };
    sqlx::query(&take(2)).execute(&mut *tx).await.unwrap();
    let done = guard.finish(&mut tx, Ok::<u32, BookError>(2)).await;
    assert!(matches!(done, Ok(2)), "{done:?}");
    tx.commit().await.unwrap();
    drop_database(&pool, &db).await;
}

/// A statement idem gave up on is not left holding its connection: sqlx's MySQL driver
/// cannot resume a connection whose query was dropped unanswered, so idem closes it
/// (the server then rolls its transaction back) rather than return it to the pool.
/// Here a claim waits on a lock another transaction holds until idem drops it; the
/// only connection of idem's pool must then serve another request while the lock is
/// still held. Returned to the pool, the connection would wait for the claim's answer
/// first, and the request would fail on the pool's acquire timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_given_up_on_does_not_keep_its_connection() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;
    let Some((db, _url, pool)) = database("mysql_given_up").await else {
        return;
    };
    // The lock wait outlasts the acquire timeout: a connection left waiting on the lock
    // stays busy for as long as the request below waits.
    let one = pool_waiting_on_locks(&db, 1, 600, Duration::from_secs(20)).await;
    let idem = Idem::builder()
        .store_timeout(Duration::from_millis(200))
        .pool(one)
        .await
        .unwrap();
    let runs = AtomicU32::new(0);
    let charge = |key: &'static str| {
        idem.operation("charge", key)
            .lease(Duration::from_millis(200))
            .retain(Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<u32, IdemError>(7)
            })
    };

    // Every row and gap of the (empty) table locked: any claim's insert waits.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT state FROM idem_operations FOR UPDATE")
        .fetch_all(&mut *holder)
        .await
        .unwrap();
    let err = charge("a").await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    // The claim is given up on within its lease and the store timeout; this request
    // then needs the pool's one connection.
    let stats = idem.stats().await;
    assert!(
        stats.is_ok(),
        "the connection of a statement given up on was kept: {stats:?}"
    );
    holder.rollback().await.unwrap();
    assert_eq!(charge("b").await.unwrap(), 7);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "no body ran for the claim given up on"
    );
    drop_database(&pool, &db).await;
}
