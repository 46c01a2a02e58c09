//! PostgreSQL under real contention: a big pool on one key, many keys, two OS
//! processes, and serialization failures in transactional mode.
#![cfg(feature = "postgres")]
use crate::common;
use common::*;
use idem_runtime::{Idem, IdemError, TxStep};
use std::time::Duration;

async fn pool(test: &str, max: u32) -> Option<sqlx::PgPool> {
    postgres_skip(test).is_none().then_some(())?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .connect(&postgres_url())
        .await;
    reached_or_skip(test, "PostgreSQL", &postgres_url(), pool)
}

async fn schema(pool: &sqlx::PgPool, test: &str) -> String {
    let schema = unique_table(test);
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(pool)
        .await
        .unwrap();
    schema
}

async fn idem_on(pool: &sqlx::PgPool, schema: &str) -> Idem {
    Idem::builder()
        .table(format!("{schema}.idem_operations"))
        // Tens of thousands of calls queue on a few connections here: the queueing is
        // not what these tests measure (tests/suite/wire_faults.rs tests the bound).
        .store_timeout(std::time::Duration::from_secs(120))
        .pool(pool.clone())
        .await
        .unwrap()
}

/// idem on `table` without the in-process replay cache, so every replay reaches the
/// database; for a test to set more before opening it.
fn uncached_builder(table: &str, migrate: bool) -> idem_runtime::IdemBuilder {
    Idem::builder()
        .table(table)
        .migrate(migrate)
        .replay_cache_bytes(0)
}

/// [`uncached_builder`], opened on `pool`.
async fn uncached(pool: &sqlx::PgPool, table: &str, migrate: bool) -> Idem {
    uncached_builder(table, migrate)
        .pool(pool.clone())
        .await
        .unwrap()
}

/// Spawns `n` callers, `call(i)` each, released together once all are spawned.
fn spawn_together<F, Fut>(n: usize, call: F) -> Vec<tokio::task::JoinHandle<Fut::Output>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    (0..n)
        .map(|i| {
            let (call, barrier) = (call(i), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                call.await
            })
        })
        .collect()
}

/// The call the replay tests repeat: a quote of 42 under one key.
async fn quote(idem: &Idem) -> u32 {
    idem.operation("quote", "q-1")
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(42u32) })
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_tasks_twenty_connections_one_key() {
    let Some(pool) = pool("two_hundred", 20).await else {
        return;
    };
    let schema = schema(&pool, "two_hundred").await;
    let idem = idem_on(&pool, &schema).await;
    contend_one_key(&idem, 200, 50).await;
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_keys_four_callers_each() {
    let Some(pool) = pool("ten_thousand", 20).await else {
        return;
    };
    let schema = schema(&pool, "ten_thousand").await;
    let idem = idem_on(&pool, &schema).await;
    const KEYS: usize = 10_000;
    assert_eq!(contend_many_keys(&idem, KEYS, 4).await, KEYS);
    let rows: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {schema}.idem_operations WHERE state = 1"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, KEYS as i64);
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_race_on_the_same_keys() {
    let Some(pool) = pool("two_processes", 4).await else {
        return;
    };
    let schema = schema(&pool, "two_processes").await;
    sqlx::query(&format!(
        "CREATE TABLE {schema}.effects (key BIGINT PRIMARY KEY, worker TEXT NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    // Create idem's table before the race, so both workers race on claims, not DDL.
    idem_on(&pool, &schema).await;
    const KEYS: u32 = 1_000;
    let ran = race_two_processes(&postgres_url(), &schema, KEYS).await;
    assert_eq!(ran, KEYS, "each key's body ran once in total");
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.effects"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, i64::from(KEYS));
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_conflict_is_a_retryable_store_error() {
    let Some(pool) = pool("repeatable_read", 4).await else {
        return;
    };
    let schema = schema(&pool, "repeatable_read").await;
    let idem = idem_on(&pool, &schema).await;
    let op = || {
        idem.operation("book", "seat-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
    };

    let mut first = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *first)
        .await
        .unwrap();
    let guard = match op()
        .begin_tx::<_, u32, IdemError>(&mut first)
        .await
        .unwrap()
    {
        TxStep::Run(g) => g,
        TxStep::Replay(_) => panic!("fresh key"),
    };

    let mut second = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *second)
        .await
        .unwrap();
    // Take the snapshot now, before the first commits.
    sqlx::query("SELECT 1").execute(&mut *second).await.unwrap();
    let blocked = tokio::spawn(async move {
        let r = idem
            .operation("book", "seat-1")
            .retain(std::time::Duration::from_secs(86_400))
            .fingerprint_none()
            .begin_tx::<_, u32, IdemError>(&mut second)
            .await;
        r.map(|_| ())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        guard
            .finish(&mut first, Ok::<u32, IdemError>(7))
            .await
            .unwrap(),
        7
    );
    first.commit().await.unwrap();
    match blocked.await.unwrap() {
        Err(e @ IdemError::Store { .. }) => assert!(e.is_retryable(), "{e}"),
        other => panic!("expected a retryable store error, got {other:?}"),
    }
    drop_schema(&pool, &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_neither_locks_nor_writes_the_row() {
    let Some(pool) = pool("replay_no_write", 4).await else {
        return;
    };
    let schema = schema(&pool, "replay_no_write").await;
    let idem = uncached(&pool, &format!("{schema}.idem_operations"), true).await;
    assert_eq!(quote(&idem).await, 42);
    // xmin changes on a write, xmax on a row lock (ON CONFLICT DO UPDATE takes one even
    // when its WHERE is false).
    let version = format!("SELECT xmin::text || '/' || xmax::text FROM {schema}.idem_operations");
    let before: String = sqlx::query_scalar(&version).fetch_one(&pool).await.unwrap();
    for _ in 0..20 {
        assert_eq!(quote(&idem).await, 42);
    }
    let after: String = sqlx::query_scalar(&version).fetch_one(&pool).await.unwrap();
    assert_eq!(before, after, "a replay touched the row");
    drop_schema(&pool, &schema).await;
}

/// Once replays come in, a replay is answered by a read-only statement: with the
/// store's role stripped of `INSERT` and `UPDATE` on the table, retries still replay
/// (the claim statement, an upsert, would be refused by the permission check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_replays_is_answered_by_reads() {
    let Some(pool) = pool("replay_reads", 4).await else {
        return;
    };
    let schema = schema(&pool, "replay_reads").await;
    let table = format!("{schema}.idem_operations");
    drop(idem_on(&pool, &schema).await);
    let role = format!("{schema}_reader");
    let role_pool = role_pool(&pool, &schema, &role, &[]).await;
    let idem = uncached(&role_pool, &table, false).await;
    assert_eq!(quote(&idem).await, 42);
    // The first replay is decided by the claim; it tells the store replays are coming.
    assert_eq!(quote(&idem).await, 42);
    sqlx::query(&format!("REVOKE INSERT, UPDATE ON {table} FROM {role}"))
        .execute(&pool)
        .await
        .unwrap();
    for _ in 0..3 {
        // A replay that needed more than a read fails here: permission denied.
        assert_eq!(quote(&idem).await, 42);
    }
    drop(idem);
    drop_role(&pool, role_pool, &schema, &role).await;
}

/// A login role `role` on the tables of `schema` (idem's table opened there already),
/// with every right idem uses but those in `revoked`, and a pool of its connections.
async fn role_pool(
    pool: &sqlx::PgPool,
    schema: &str,
    role: &str,
    revoked: &[&str],
) -> sqlx::PgPool {
    use std::str::FromStr;
    let table = format!("{schema}.idem_operations");
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"),
        format!("GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
    ] {
        sqlx::query(&sql).execute(pool).await.unwrap();
    }
    if !revoked.is_empty() {
        let revoke = format!("REVOKE {} ON {table} FROM {role}", revoked.join(", "));
        sqlx::query(&revoke).execute(pool).await.unwrap();
    }
    let as_role = sqlx::postgres::PgConnectOptions::from_str(&postgres_url())
        .unwrap()
        .username(role);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(as_role)
        .await
        .unwrap()
}

/// Closes `role_pool`, then drops `schema` and `role`.
async fn drop_role(pool: &sqlx::PgPool, role_pool: sqlx::PgPool, schema: &str, role: &str) {
    role_pool.close().await;
    drop_schema(pool, schema).await;
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(&sql).execute(pool).await.unwrap();
    }
}

/// Group commit: fresh calls on distinct keys arriving together, more than there are
/// connections, share statements and transactions, their claims and then their records
/// several rows to a transaction (rows one transaction wrote share its `xmin`), and each
/// caller still gets its own outcome from its body's one run. With group commit off,
/// each claim and record is a transaction of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_fresh_calls_share_transactions() {
    let Some(pool) = pool("group_commit", 16).await else {
        return;
    };
    let schema = schema(&pool, "group_commit").await;
    for group_commit in [true, false] {
        let table = format!("{schema}.ops_{group_commit}");
        let idem = uncached_builder(&table, true)
            .group_commit(group_commit)
            .pool(pool.clone())
            .await
            .unwrap();
        let [claims, records] = fresh_calls_together(&idem, &pool, &table).await;
        for (what, (rows, transactions)) in [("claims", claims), ("records", records)] {
            assert_eq!(rows, 64);
            if group_commit {
                assert!(
                    transactions < rows,
                    "{rows} {what} took {transactions} transactions: none were gathered"
                );
            } else {
                assert_eq!(
                    transactions, rows,
                    "{what} were gathered with group commit off"
                );
            }
        }
    }
    drop_schema(&pool, &schema).await;
}

/// 64 fresh calls on distinct keys, released together; for the claims (counted while
/// every body runs) and then the records: rows, and the transactions that wrote them.
async fn fresh_calls_together(idem: &Idem, pool: &sqlx::PgPool, table: &str) -> [(i64, i64); 2] {
    use std::sync::Arc;
    const CALLERS: usize = 64;
    let runs = Counter::default();
    // The bodies hold at `claimed` until every claim is in, then at `finish` until the
    // claims' transactions have been counted.
    let claimed = Arc::new(tokio::sync::Barrier::new(CALLERS + 1));
    let finish = Arc::new(tokio::sync::Barrier::new(CALLERS + 1));
    // Group commit gathers only while every connection is in use. The test holds them
    // all while the callers arrive, so whether they gather does not hang on how fast
    // the pool grows or the machine runs.
    let held = hold_every_connection(pool).await;
    let callers: Vec<_> = (0..CALLERS)
        .map(|i| {
            let (idem, runs) = (idem.clone(), runs.clone());
            let (claimed, finish) = (claimed.clone(), finish.clone());
            tokio::spawn(async move {
                idem.operation("ship", &i)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(move || async move {
                        runs.hit();
                        claimed.wait().await;
                        finish.wait().await;
                        Ok::<_, IdemError>(i * 2)
                    })
                    .await
            })
        })
        .collect();
    let transactions = |state: i16| {
        let sql = format!(
            "SELECT count(*), count(DISTINCT xmin::text) FROM {table} WHERE state = {state}"
        );
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (i64, i64)>(&sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let_callers_queue(held).await;
    claimed.wait().await;
    let claims = transactions(0).await;
    let held = hold_every_connection(pool).await;
    finish.wait().await;
    let_callers_queue(held).await;
    for (i, caller) in callers.into_iter().enumerate() {
        assert_eq!(caller.await.unwrap().unwrap(), i * 2);
    }
    assert_eq!(runs.get(), CALLERS);
    [claims, transactions(1).await]
}

/// Takes every connection `pool` may open, so idem finds them all in use.
async fn hold_every_connection(
    pool: &sqlx::PgPool,
) -> Vec<sqlx::pool::PoolConnection<sqlx::Postgres>> {
    let mut held = Vec::new();
    for _ in 0..pool.options().get_max_connections() {
        held.push(pool.acquire().await.unwrap());
    }
    held
}

/// Gives callers released together time to reach idem's queue, then lets the
/// connections go. The assertions do not hang on this pause: callers that arrive after
/// it only make smaller batches, and two callers sharing one batch is all they ask.
async fn let_callers_queue(held: Vec<sqlx::pool::PoolConnection<sqlx::Postgres>>) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(held);
}

/// Group commit: a claim the server refuses (PostgreSQL text cannot hold a NUL byte)
/// fails alone. Its neighbours in the same batch are issued again one by one and
/// succeed, each body run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_claim_fails_alone_in_its_batch() {
    const CALLERS: usize = 24;
    let Some(pool) = pool("group_refusal", 16).await else {
        return;
    };
    let schema = schema(&pool, "group_refusal").await;
    let idem = uncached(&pool, &format!("{schema}.idem_operations"), true).await;
    let runs = Counter::default();
    for round in 0..10 {
        // Every connection busy: the callers' claims are gathered into batches.
        let held = hold_every_connection(&pool).await;
        let callers = spawn_together(CALLERS, |i| {
            let (idem, runs) = (idem.clone(), runs.clone());
            // The middle caller's key has a NUL byte.
            let key = if i == CALLERS / 2 {
                format!("bad\0{round}")
            } else {
                format!("{round}-{i}")
            };
            async move {
                idem.operation("ship", &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(move || async move {
                        runs.hit();
                        Ok::<_, IdemError>(i)
                    })
                    .await
            }
        });
        let_callers_queue(held).await;
        for (i, caller) in callers.into_iter().enumerate() {
            let got = caller.await.unwrap();
            if i == CALLERS / 2 {
                assert!(got.is_err(), "the NUL key was stored: {got:?}");
            } else {
                assert_eq!(got.unwrap(), i, "round {round}: a neighbour failed");
            }
        }
    }
    assert_eq!(runs.get(), 10 * (CALLERS - 1));
    drop(idem);
    drop_schema(&pool, &schema).await;
}

/// Group commit with new keys and recorded ones in one batch: each row is decided alone,
/// the new keys claimed in the batch's one transaction and their bodies run once, the
/// recorded ones replayed. Every caller gets its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_new_and_recorded_keys_answers_each() {
    use std::sync::Arc;
    const EACH: usize = 12;
    let Some(pool) = pool("group_mixed", 16).await else {
        return;
    };
    let schema = schema(&pool, "group_mixed").await;
    let table = format!("{schema}.idem_operations");
    let idem = uncached(&pool, &table, true).await;
    // New keys' bodies hold at `claimed` until every claim is in, then at `finish`
    // until they have been counted.
    let claimed = Arc::new(tokio::sync::Barrier::new(EACH + 1));
    let finish = Arc::new(tokio::sync::Barrier::new(EACH + 1));
    let call = |key: String, value: usize, runs: Counter, hold: bool| {
        let (idem, claimed, finish) = (idem.clone(), claimed.clone(), finish.clone());
        async move {
            idem.operation("ship", &key)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(move || async move {
                    runs.hit();
                    if hold {
                        claimed.wait().await;
                        finish.wait().await;
                    }
                    Ok::<_, IdemError>(value)
                })
                .await
        }
    };
    let recorded_runs = Counter::default();
    for i in 0..EACH {
        let first = call(format!("old-{i}"), i, recorded_runs.clone(), false);
        assert_eq!(first.await.unwrap(), i);
    }
    let fresh_runs = Counter::default();
    let held = hold_every_connection(&pool).await;
    let callers = spawn_together(2 * EACH, |n| {
        // Alternating, so recorded and new keys sit side by side in the batches.
        let (key, runs, hold) = if n % 2 == 0 {
            (format!("old-{}", n / 2), recorded_runs.clone(), false)
        } else {
            (format!("new-{}", n / 2), fresh_runs.clone(), true)
        };
        call(key, n / 2 + 100, runs, hold)
    });
    let_callers_queue(held).await;
    claimed.wait().await;
    let (rows, transactions): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT xmin::text) FROM {table} WHERE state = 0"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    finish.wait().await;
    assert_eq!(rows, EACH as i64);
    assert!(
        transactions < rows,
        "{rows} new keys claimed in {transactions} transactions: none were gathered"
    );
    for (n, caller) in callers.into_iter().enumerate() {
        let got = caller.await.unwrap().unwrap();
        // A recorded key replays the value its first call recorded.
        let want = if n % 2 == 0 { n / 2 } else { n / 2 + 100 };
        assert_eq!(got, want, "caller {n}");
    }
    assert_eq!(recorded_runs.get(), EACH, "a recorded key ran again");
    assert_eq!(fresh_runs.get(), EACH);
    drop(idem);
    drop_schema(&pool, &schema).await;
}

/// The purge deletes without locking rows first; a row another transaction holds (here
/// a `FOR UPDATE`, as a caller's transaction that took over an expired record holds
/// it) ends that statement on its wait limit, and the purge goes on past the row
/// instead of waiting for the transaction or failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_goes_past_a_row_another_transaction_holds() {
    let Some(pool) = pool("purge_held_row", 4).await else {
        return;
    };
    let schema = schema(&pool, "purge_held_row").await;
    let table = format!("{schema}.idem_operations");
    let idem = uncached(&pool, &table, true).await;
    for key in ["k0", "k1", "k2"] {
        idem.operation("ship", key)
            .retain(Duration::from_millis(50))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(()) })
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut holder = pool.begin().await.unwrap();
    // (A locking read with OFFSET would lock the rows it skips too.)
    let held: String = sqlx::query_scalar(&format!(
        "SELECT key FROM {table} ORDER BY key OFFSET 1 LIMIT 1"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    sqlx::query(&format!("SELECT 1 FROM {table} WHERE key = $1 FOR UPDATE"))
        .bind(&held)
        .execute(&mut *holder)
        .await
        .unwrap();
    // Only a guard against hanging the suite: without its wait limit, the purge would
    // wait on the holder, which waits on the purge.
    let purged = tokio::time::timeout(Duration::from_secs(120), idem.purge_expired())
        .await
        .expect("the purge waited on the held row");
    assert_eq!(
        purged.unwrap(),
        2,
        "the two free rows go, the held one stays"
    );
    holder.rollback().await.unwrap();
    let left: Vec<String> = sqlx::query_scalar(&format!("SELECT key FROM {table}"))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, [held]);
    assert_eq!(idem.purge_expired().await.unwrap(), 1);
    drop(idem);
    drop_schema(&pool, &schema).await;
}

/// A fresh key is claimed by a plain insert (`claim_fresh.sql`), lighter than the
/// full claim's upsert, alone and gathered into a batch (`claim_fresh_batch.sql`): under
/// a role that may insert but not update, the claims of new keys still succeed and their
/// bodies run (the upsert would be refused before it inserted anything); the records,
/// updates, are then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_key_is_claimed_by_a_plain_insert() {
    const GATHERED: usize = 8;
    let Some(pool) = pool("fresh_insert", 4).await else {
        return;
    };
    let schema = schema(&pool, "fresh_insert").await;
    let table = format!("{schema}.idem_operations");
    drop(idem_on(&pool, &schema).await);
    let role = format!("{schema}_inserter");
    // UPDATE on idem's table only: opening records the key mode in its `_meta` table.
    let role_pool = role_pool(&pool, &schema, &role, &["UPDATE"]).await;
    let call = |idem: &Idem, key: String, runs: &Counter| {
        let (idem, runs) = (idem.clone(), runs.clone());
        async move {
            idem.operation("ship", &key)
                .retain(std::time::Duration::from_secs(86_400))
                .fingerprint_none()
                .run(|| async {
                    runs.hit();
                    Ok::<_, IdemError>(1u32)
                })
                .await
        }
    };

    // Alone: group commit off, so no busy moment of the small pool gathers the claim.
    let idem = uncached_builder(&table, false)
        .group_commit(false)
        .pool(role_pool.clone())
        .await
        .unwrap();
    let runs = Counter::default();
    let result = call(&idem, "new-key".into(), &runs).await;
    assert_eq!(
        runs.get(),
        1,
        "the claim of a new key was refused: {result:?}"
    );
    assert!(
        matches!(result, Err(IdemError::Unrecorded { .. })),
        "{result:?}"
    );
    drop(idem);
    sqlx::query(&format!("DELETE FROM {table}"))
        .execute(&pool)
        .await
        .unwrap();

    // Gathered: every connection busy while the callers arrive.
    let idem = uncached_builder(&table, false)
        .pool(role_pool.clone())
        .await
        .unwrap();
    let runs = Counter::default();
    let held = hold_every_connection(&role_pool).await;
    let callers = spawn_together(GATHERED, |i| call(&idem, format!("batch-{i}"), &runs));
    let_callers_queue(held).await;
    for caller in callers {
        let result = caller.await.unwrap();
        assert!(
            matches!(result, Err(IdemError::Unrecorded { .. })),
            "a gathered claim of a new key was refused: {result:?}"
        );
    }
    assert_eq!(runs.get(), GATHERED);
    let (rows, transactions): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT xmin::text) FROM {table}"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, GATHERED as i64);
    assert!(
        transactions < rows,
        "{rows} new keys claimed in {transactions} transactions: none were gathered"
    );
    drop(idem);
    drop_role(&pool, role_pool, &schema, &role).await;
}

/// A waiter on another handle (another process, as far as the store knows) whose poll
/// interval is an hour gets the outcome when the first handle records it: the record
/// found the waiter's flag on the row and sent the wake-up the waiter's handle listens
/// for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_handle_wakes_waiters_through_notify() {
    waiter_woken_through_notify("another_handle_wakes_waiters_through_notify", false).await;
}

/// The same where the first handle's record is gathered for group commit (every
/// connection of its pool is in use as its body ends) and issued alone, as a batch of
/// one is: the record statement returns the waiter's flag, and the wake-up follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gathered_record_wakes_waiters_through_notify() {
    waiter_woken_through_notify("a_gathered_record_wakes_waiters_through_notify", true).await;
}

async fn waiter_woken_through_notify(test: &str, gathered: bool) {
    let Some(db) = pool(test, 2).await else {
        return;
    };
    // Gathered: the first handle works on a small pool of its own, which the test holds
    // whole as that handle's body ends.
    let owner_pool = if gathered { pool(test, 2).await } else { None };
    let schema = schema(&db, test).await;
    let table = format!("{schema}.idem_operations");
    // The waiter's connections carry a name of their own, so its listener can be told
    // from every other test's.
    let sep = if postgres_url().contains('?') {
        '&'
    } else {
        '?'
    };
    let waiter_url = format!("{}{sep}application_name={schema}", postgres_url());
    let owner = uncached_builder(&table, true).poll_interval(Duration::from_millis(200));
    let owner = match &owner_pool {
        Some(owner_pool) => owner.pool(owner_pool.clone()).await,
        None => owner.postgres(&postgres_url()).await,
    }
    .unwrap();
    let waiter = uncached_builder(&table, true)
        .poll_interval(Duration::from_secs(3600))
        .postgres(&waiter_url)
        .await
        .unwrap();
    // A wake-up sent before the waiter's handle listens would be missed.
    let listening = "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = $1 AND query ILIKE 'LISTEN%'";
    while sqlx::query_scalar::<_, i64>(listening)
        .bind(&schema)
        .fetch_one(&db)
        .await
        .unwrap()
        == 0
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let flagged = format!("SELECT waiters FROM {table} WHERE name = 'send'");
    let flagged = || async {
        sqlx::query_scalar::<_, bool>(&flagged)
            .fetch_one(&db)
            .await
            .unwrap()
    };
    let finish = async |go: tokio::sync::oneshot::Sender<()>| match &owner_pool {
        // The body ends while every connection is in use: its record is gathered.
        Some(owner_pool) => {
            let held = hold_every_connection(owner_pool).await;
            go.send(()).unwrap();
            let_callers_queue(held).await;
        }
        None => go.send(()).unwrap(),
    };
    let woken = waiter_on_another_handle_finishing(owner, waiter, flagged, finish).await;
    assert_eq!(woken, 7);
}
