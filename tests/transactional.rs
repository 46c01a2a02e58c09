//! Transactional mode: the claim and the record commit or roll back with the caller's
//! own writes.
mod common;
use common::*;
use idem_runtime::{Idem, TxStep};
use std::sync::Arc;

macro_rules! tx_suite {
    ($module:ident, $db:ty, $ph:literal, $open:expr, $begin:expr, $begin_cancellable:expr, $after_cancel:expr) => {
        mod $module {
            use super::*;

            const INSERT: &str = concat!("INSERT INTO orders (id, qty) VALUES (", $ph, ")");

            async fn insert(tx: &mut sqlx::Transaction<'static, $db>, id: &str, qty: i64) -> Result<(), sqlx::Error> {
                sqlx::query(INSERT).bind(id).bind(qty).execute(&mut **tx).await.map(drop)
            }

            /// Places an order in `tx`: one business row, claimed and recorded in the
            /// same transaction. `fail` makes the body write, then return a released error.
            async fn place(
                idem: &Idem,
                tx: &mut sqlx::Transaction<'static, $db>,
                order: &str,
                qty: i64,
                fail: bool,
            ) -> Result<i64, AppError> {
                let op = idem.operation("place_order", order).fingerprint(&qty).retain(std::time::Duration::from_secs(86_400));
                let guard = match op.begin_tx(&mut *tx).await? {
                    TxStep::Replay(out) => return out,
                    TxStep::Run(g) => g,
                };
                let out = async {
                    insert(&mut *tx, order, qty).await.map_err(|e| AppError::Declined(e.to_string()))?;
                    if fail { Err(AppError::Timeout) } else { Ok(qty * 100) }
                }
                .await;
                guard.finish(&mut *tx, out).await
            }

            async fn orders(pool: &sqlx::Pool<$db>, table: &str) -> i64 {
                sqlx::query_scalar(&format!("SELECT count(*) FROM {table}")).fetch_one(pool).await.unwrap()
            }

            /// Drops what a PostgreSQL or MySQL test made: the schema (database) holding
            /// both tables. PostgreSQL needs `CASCADE`, MySQL refuses it.
            async fn drop_orders(pool: &sqlx::Pool<$db>, orders_table: &str) {
                if let Some((schema, _)) = orders_table.split_once('.') {
                    for drop in ["DROP SCHEMA IF EXISTS {} CASCADE", "DROP SCHEMA IF EXISTS {}"] {
                        let drop = drop.replace("{}", schema);
                        if sqlx::query(&drop).execute(pool).await.is_ok() {
                            break;
                        }
                    }
                }
            }

            async fn setup(test: &str) -> Option<(sqlx::Pool<$db>, Idem, String, Option<tempfile::TempDir>)> {
                $open(test).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn committed_once_then_replayed() {
                let Some((pool, idem, orders_table, _dir)) = setup("committed_once").await else { return };
                for _ in 0..3 {
                    let mut tx = $begin(&pool).await;
                    let got = place(&idem, &mut tx, "o-1", 3, false).await.unwrap();
                    assert_eq!(got, 300);
                    tx.commit().await.unwrap();
                }
                assert_eq!(orders(&pool, &orders_table).await, 1);
                drop_orders(&pool, &orders_table).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn released_error_keeps_neither_writes_nor_claim() {
                let Some((pool, idem, orders_table, _dir)) = setup("released_error").await else { return };
                let mut tx = $begin(&pool).await;
                let r = place(&idem, &mut tx, "o-2", 1, true).await;
                assert_eq!(r, Err(AppError::Timeout));
                tx.commit().await.unwrap();
                assert_eq!(orders(&pool, &orders_table).await, 0, "the body's write was rolled back");
                let mut tx = $begin(&pool).await;
                assert_eq!(place(&idem, &mut tx, "o-2", 1, false).await.unwrap(), 100);
                tx.commit().await.unwrap();
                assert_eq!(orders(&pool, &orders_table).await, 1);
                drop_orders(&pool, &orders_table).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn rolled_back_attempt_leaves_nothing() {
                let Some((pool, idem, orders_table, _dir)) = setup("rolled_back").await else { return };
                let mut tx = $begin(&pool).await;
                place(&idem, &mut tx, "o-3", 2, false).await.unwrap();
                tx.rollback().await.unwrap();
                assert_eq!(idem.stats().await.unwrap().completed, 0);
                let mut tx = $begin(&pool).await;
                assert_eq!(place(&idem, &mut tx, "o-3", 5, false).await.unwrap(), 500, "the key is free again");
                tx.commit().await.unwrap();
                assert_eq!(orders(&pool, &orders_table).await, 1);
                drop_orders(&pool, &orders_table).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn mismatch_in_transaction() {
                let Some((pool, idem, _t, _dir)) = setup("mismatch_tx").await else { return };
                let mut tx = $begin(&pool).await;
                place(&idem, &mut tx, "o-4", 2, false).await.unwrap();
                tx.commit().await.unwrap();
                let mut tx = $begin(&pool).await;
                let r = place(&idem, &mut tx, "o-4", 9, false).await;
                assert!(matches!(&r, Err(AppError::Idem(m)) if m.contains("different payload")), "{r:?}");
                drop(tx);
                drop_orders(&pool, &_t).await;
            }

            /// A body that rolls back to idem's savepoint takes the claim with it: its
            /// `Ok` is refused with a `Config` error, never answered as if recorded (a
            /// commit and a retry would then run the body twice).
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_claim_the_body_rolled_back_is_refused() {
                let Some((pool, idem, orders_table, _dir)) = setup("claim_rolled_back").await else { return };
                let mut tx = $begin(&pool).await;
                let op = idem
                    .operation("place_order", "o-10")
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint(&1i64);
                let TxStep::Run(guard) = op.begin_tx::<_, i64, AppError>(&mut tx).await.unwrap() else {
                    panic!("fresh key replayed");
                };
                sqlx::raw_sql("ROLLBACK TO SAVEPOINT idem_body").execute(&mut *tx).await.unwrap();
                insert(&mut tx, "o-10", 1).await.unwrap();
                let r = guard.finish(&mut tx, Ok(7)).await;
                assert!(matches!(&r, Err(AppError::Idem(m)) if m.contains("vanished")), "{r:?}");
                drop(tx);
                drop_orders(&pool, &orders_table).await;
            }

            // One operation instantiated per backend: the name is shared on purpose.
            #[idem_runtime::idempotent(store = idem, key = order, retain = "1d", tx = tx, name = "ship")]
            async fn ship(
                idem: &Idem,
                tx: &mut sqlx::Transaction<'static, $db>,
                order: &str,
            ) -> Result<(u64, String), AppError> {
                let _ = &tx;
                // The running operation is visible in a transactional body too.
                let cur = idem_runtime::current();
                Ok((cur.epoch(), cur.downstream_key("carrier")))
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn current_is_set_in_a_transactional_body() {
                let Some((pool, idem, orders_table, _dir)) = setup("current_tx").await else { return };
                let mut tx = $begin(&pool).await;
                let (epoch, key) = ship(&idem, &mut tx, "o-8").await.unwrap();
                tx.commit().await.unwrap();
                assert!(epoch >= 1);
                assert_eq!(key.len(), 64);
                assert!(idem_runtime::try_current().is_none());
                drop_orders(&pool, &orders_table).await;
            }

            /// Random schedules of transactional calls on a few keys: callers commit or
            /// roll back, bodies fail with a released error, roll back to idem's own
            /// savepoint, or are cancelled mid-way. Whatever the schedule, each key
            /// commits at most one body's writes, and every committed `Ok` answer is
            /// that body's value. `IDEM_MODEL_SEED` / `IDEM_MODEL_RUNS` as in
            /// tests/model.rs.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn model_random_schedules() {
                use rand::{Rng, SeedableRng};
                let Some((pool, idem, orders_table, _dir)) = setup("tx_model").await else { return };
                let seeds = tx_model_seeds();
                for &seed in &seeds {
                    // (key, value answered, whether the caller committed)
                    let answers = Arc::new(std::sync::Mutex::new(Vec::<(String, i64, bool)>::new()));
                    let mut callers = Vec::new();
                    for caller in 0..4u64 {
                        let (pool, idem, answers) = (pool.clone(), idem.clone(), answers.clone());
                        callers.push(tokio::spawn(async move {
                            let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 100 + caller);
                            for step in 0..8u64 {
                                let key = format!("m{seed}-{}", rng.gen_range(0..3));
                                let behavior = rng.gen_range(0..100);
                                let cancel_after = std::time::Duration::from_micros(rng.gen_range(0..3000));
                                let cancellable = (90..100).contains(&behavior);
                                let mut tx = if cancellable { $begin_cancellable(&pool).await } else { $begin(&pool).await };
                                let op = idem
                                    .operation("tx_model", key.as_str())
                                    .fingerprint_none()
                                    .retain(std::time::Duration::from_secs(3600))
                                    .lease(std::time::Duration::from_millis(300));
                                let call = async {
                                    let guard = match op.begin_tx::<_, i64, AppError>(&mut tx).await? {
                                        TxStep::Replay(out) => return out,
                                        TxStep::Run(g) => g,
                                    };
                                    let value = (caller * 100 + step) as i64;
                                    let body = async {
                                        if (60..70).contains(&behavior) {
                                            // The body undoes idem's claim along with its own work.
                                            sqlx::query("ROLLBACK TO SAVEPOINT idem_body")
                                                .execute(&mut *tx)
                                                .await
                                                .map_err(|e| AppError::Declined(e.to_string()))?;
                                        }
                                        let id = format!("{key}#{caller}#{step}");
                                        insert(&mut tx, &id, value)
                                            .await
                                            .map_err(|e| AppError::Declined(e.to_string()))?;
                                        if (40..60).contains(&behavior) {
                                            return Err(AppError::Timeout);
                                        }
                                        Ok(value)
                                    }
                                    .await;
                                    guard.finish(&mut tx, body).await
                                };
                                let mut cancelled = false;
                                let out = if cancellable {
                                    match tokio::time::timeout(cancel_after, call).await {
                                        Ok(out) => out,
                                        Err(_) => {
                                            cancelled = true;
                                            Err(AppError::Timeout)
                                        }
                                    }
                                } else {
                                    call.await
                                };
                                if cancelled {
                                    $after_cancel(tx).await;
                                    continue;
                                }
                                // A caller keeps its transaction only for a success or the
                                // released error the contract lets it commit after.
                                let commit = matches!(out, Ok(_) | Err(AppError::Timeout))
                                    && !(70..90).contains(&behavior)
                                    && !cancellable;
                                let committed = if commit { tx.commit().await.is_ok() } else {
                                    let _ = tx.rollback().await;
                                    false
                                };
                                if let Ok(v) = out {
                                    answers.lock().unwrap().push((key, v, committed));
                                }
                            }
                        }));
                    }
                    for c in callers {
                        c.await.unwrap();
                    }
                    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
                        "SELECT id, qty FROM {orders_table} WHERE id LIKE 'm{seed}-%'"
                    ))
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                    let mut by_key = std::collections::HashMap::<String, Vec<i64>>::new();
                    for (id, qty) in rows {
                        let key = id.split('#').next().unwrap().to_owned();
                        by_key.entry(key).or_default().push(qty);
                    }
                    let mut violations = Vec::new();
                    for (key, values) in &by_key {
                        if values.len() > 1 {
                            violations.push(format!("key {key} committed {} bodies' writes: {values:?}", values.len()));
                        }
                    }
                    for (key, v, committed) in answers.lock().unwrap().iter() {
                        let written = by_key.get(key).map(Vec::as_slice).unwrap_or(&[]);
                        if *committed && written != [*v] {
                            violations.push(format!("key {key} answered {v} and committed, but its writes are {written:?}"));
                        }
                    }
                    assert!(
                        violations.is_empty(),
                        "transactional model, seed {seed} (rerun with IDEM_MODEL_SEED={seed}):\n{}",
                        violations.join("\n")
                    );
                }
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "transactional model on {}: {} schedules of 4 callers x 8 steps passed, seeds {seeds:?}",
                    stringify!($module),
                    seeds.len()
                );
                drop_orders(&pool, &orders_table).await;
            }

            /// A cancelled body whose caller commits anyway leaves a claim that holds
            /// while its lease runs (a duplicate is told it is already running) and
            /// lapses after it, like a leased one: the key is never blocked for good.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn abandoned_claim_is_taken_over_after_its_lease() {
                let Some((pool, idem, orders_table, _dir)) = setup("abandoned").await else { return };
                // Commits a claim of `order` with `lease` whose body is dropped mid-way
                // (a timeout): no finish.
                let abandon = |order: &'static str, lease| {
                    let (pool, idem) = (pool.clone(), idem.clone());
                    async move {
                        let mut tx = $begin(&pool).await;
                        let op = idem.operation("place_order", order).fingerprint(&1i64).lease(lease).retain(std::time::Duration::from_secs(86_400));
                        match op.begin_tx::<_, i64, AppError>(&mut tx).await.unwrap() {
                            TxStep::Run(guard) => drop(guard),
                            TxStep::Replay(_) => panic!("fresh key replayed"),
                        }
                        tx.commit().await.unwrap();
                    }
                };
                let lease = std::time::Duration::from_millis(300);
                abandon("o-5", lease).await;
                // Within the lease a duplicate is refused: shown on a claim leased for a
                // minute, so no slow commit or claim can see it lapse first.
                abandon("o-9", std::time::Duration::from_secs(60)).await;
                let mut tx = $begin(&pool).await;
                let r = place(&idem, &mut tx, "o-9", 1, false).await;
                assert!(matches!(&r, Err(AppError::Idem(m)) if m.contains("already running")), "{r:?}");
                drop(tx);
                // Past the lease the short claim is taken over (any later, all the more).
                tokio::time::sleep(lease + std::time::Duration::from_millis(200)).await;
                let mut tx = $begin(&pool).await;
                assert_eq!(place(&idem, &mut tx, "o-5", 1, false).await.unwrap(), 100);
                tx.commit().await.unwrap();
                assert_eq!(orders(&pool, &orders_table).await, 1);

                // A leased call takes over an abandoned transactional claim too.
                abandon("o-6", lease).await;
                tokio::time::sleep(lease + std::time::Duration::from_millis(200)).await;
                let (v, info) = idem_runtime::observe(
                    idem.operation("place_order", "o-6")
                        .fingerprint(&1i64)
                        .retain(std::time::Duration::from_secs(86_400)).run(|| async { Ok::<_, AppError>(7i64) }),
                )
                .await;
                assert_eq!(v.unwrap(), 7);
                assert!(info.epoch().is_some(), "the leased call ran the body");
                drop_orders(&pool, &orders_table).await;
            }

            /// With `errors = record`, a body whose own SQL failed (which aborts a
            /// PostgreSQL transaction) still gets its error recorded and returned, never
            /// a store error in its place.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn recorded_error_after_the_body_sql_failed() {
                let Some((pool, idem, orders_table, _dir)) = setup("recorded_sql_error").await else { return };
                let mut tx = $begin(&pool).await;
                insert(&mut tx, "taken", 1).await.unwrap();
                tx.commit().await.unwrap();
                for attempt in 0..2 {
                    let mut tx = $begin(&pool).await;
                    let op = idem.operation("place_order", "o-7").fingerprint(&2i64).record_errors().retain(std::time::Duration::from_secs(86_400));
                    let r: Result<i64, AppError> = match op.begin_tx(&mut tx).await {
                        Ok(TxStep::Replay(out)) => {
                            assert_eq!(attempt, 1, "replayed on the first call");
                            out
                        }
                        Ok(TxStep::Run(guard)) => {
                            assert_eq!(attempt, 0, "ran again after the error was recorded");
                            // A duplicate primary key: the body's own statement fails.
                            let out = insert(&mut tx, "taken", 2)
                                .await
                                .map(|()| 0)
                                .map_err(|_| AppError::Declined("duplicate order".into()));
                            guard.finish(&mut tx, out).await
                        }
                        Err(e) => panic!("{e}"),
                    };
                    assert_eq!(r, Err(AppError::Declined("duplicate order".into())));
                    tx.commit().await.unwrap();
                }
                assert_eq!(orders(&pool, &orders_table).await, 1);
                drop_orders(&pool, &orders_table).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_duplicates_write_once() {
                let Some((pool, idem, orders_table, _dir)) = setup("concurrent_tx").await else { return };
                const KEYS: usize = 50;
                const CALLERS: usize = 4;
                let barrier = Arc::new(tokio::sync::Barrier::new(KEYS * CALLERS));
                let tasks: Vec<_> = (0..KEYS * CALLERS)
                    .map(|i| {
                        let (pool, idem, barrier) = (pool.clone(), idem.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            let key = format!("c-{}", i % KEYS);
                            // Serialization failures and lock timeouts are retryable: retry
                            // the whole transaction, as a caller would.
                            for _ in 0..50 {
                                let mut tx = $begin(&pool).await;
                                match place(&idem, &mut tx, &key, 1, false).await {
                                    Ok(v) => {
                                        if tx.commit().await.is_ok() {
                                            return v;
                                        }
                                    }
                                    Err(AppError::Idem(m)) if m.contains("store error") => {}
                                    Err(e) => panic!("{e:?}"),
                                }
                            }
                            panic!("no attempt committed");
                        })
                    })
                    .collect();
                for t in tasks {
                    assert_eq!(t.await.unwrap(), 100);
                }
                assert_eq!(orders(&pool, &orders_table).await, KEYS as i64);
                drop_orders(&pool, &orders_table).await;
            }
        }
    };
}

async fn open_sqlite(
    test: &str,
) -> Option<(sqlx::SqlitePool, Idem, String, Option<tempfile::TempDir>)> {
    let _ = test;
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
    Some((pool, idem, "orders".into(), Some(dir)))
}

/// The seeds of the transactional model: `IDEM_MODEL_SEED` replays one,
/// `IDEM_MODEL_RUNS` runs more.
fn tx_model_seeds() -> Vec<u64> {
    if let Ok(seed) = std::env::var("IDEM_MODEL_SEED") {
        return vec![seed.parse().expect("IDEM_MODEL_SEED is a number")];
    }
    let runs = std::env::var("IDEM_MODEL_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    (1..=runs).collect()
}

async fn begin_sqlite(pool: &sqlx::SqlitePool) -> sqlx::Transaction<'static, sqlx::Sqlite> {
    // SQLite has no row locks: take the write lock up front so a duplicate waits on it.
    pool.begin_with("BEGIN IMMEDIATE").await.unwrap()
}

/// Rolls back a transaction whose call was cancelled mid-way: the SQLite and PostgreSQL
/// drivers keep such a connection usable.
async fn rollback<DB: sqlx::Database>(tx: sqlx::Transaction<'static, DB>) {
    let _ = tx.rollback().await;
}

tx_suite!(
    sqlite,
    sqlx::Sqlite,
    "?1, ?2",
    open_sqlite,
    begin_sqlite,
    begin_sqlite,
    rollback
);

#[cfg(feature = "postgres")]
async fn open_pg(test: &str) -> Option<(sqlx::PgPool, Idem, String, Option<tempfile::TempDir>)> {
    postgres_skip(test).is_none().then_some(())?;
    let pool = match sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .connect(&postgres_url())
        .await
    {
        Ok(p) => p,
        Err(e) if !db_required() => {
            skip(
                test,
                &format!(
                    "PostgreSQL at {} refused the connection ({e})",
                    postgres_url()
                ),
            );
            return None;
        }
        Err(e) => panic!("PostgreSQL required: {e}"),
    };
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
    // The business table is found through the search path of each connection.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(20)
        .after_connect({
            let schema = schema.clone();
            move |conn, _| {
                let schema = schema.clone();
                Box::pin(async move {
                    sqlx::query(&format!("SET search_path TO {schema}"))
                        .execute(conn)
                        .await
                        .map(drop)
                })
            }
        })
        .connect(&postgres_url())
        .await
        .unwrap();
    Some((pool, idem, format!("{schema}.orders"), None))
}

#[cfg(feature = "postgres")]
async fn begin_pg(pool: &sqlx::PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    pool.begin().await.unwrap()
}

#[cfg(feature = "postgres")]
tx_suite!(
    postgres,
    sqlx::Postgres,
    "$1, $2",
    open_pg,
    begin_pg,
    begin_pg,
    rollback
);

/// A database of its own for each MySQL test, holding the business table and idem's
/// (default name), reached through a pool whose connections use it.
#[cfg(feature = "mysql")]
async fn open_mysql(
    test: &str,
) -> Option<(sqlx::MySqlPool, Idem, String, Option<tempfile::TempDir>)> {
    use std::str::FromStr;
    mysql_skip(test).is_none().then_some(())?;
    let admin = match sqlx::MySqlPool::connect(&mysql_url()).await {
        Ok(p) => p,
        Err(e) if !db_required() => {
            skip(
                test,
                &format!("MySQL at {} refused the connection ({e})", mysql_url()),
            );
            return None;
        }
        Err(e) => panic!("MySQL required: {e}"),
    };
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
    Some((pool, idem, format!("{db}.orders"), None))
}

#[cfg(feature = "mysql")]
async fn begin_mysql(pool: &sqlx::MySqlPool) -> sqlx::Transaction<'static, sqlx::MySql> {
    pool.begin().await.unwrap()
}

/// A transaction on a connection that is closed, not returned to the pool, when the
/// transaction is dropped: sqlx's MySQL driver cannot resume a connection whose query
/// future was dropped mid-flight (a later statement on it can wait forever for a reply,
/// or read another's), so a cancelled call's connection is closed, which makes the server
/// roll its transaction back.
#[cfg(feature = "mysql")]
async fn begin_mysql_closing(pool: &sqlx::MySqlPool) -> sqlx::Transaction<'static, sqlx::MySql> {
    let mut conn = pool.acquire().await.unwrap();
    conn.close_on_drop();
    sqlx::Transaction::begin(conn, None).await.unwrap()
}

/// Abandons a transaction whose call was cancelled: dropped, its connection closes.
#[cfg(feature = "mysql")]
async fn close_mysql(tx: sqlx::Transaction<'static, sqlx::MySql>) {
    drop(tx);
}

#[cfg(feature = "mysql")]
tx_suite!(
    mysql,
    sqlx::MySql,
    "?, ?",
    open_mysql,
    begin_mysql,
    begin_mysql_closing,
    close_mysql
);
