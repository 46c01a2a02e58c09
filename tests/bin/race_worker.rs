//! A second OS process for the process-race tests (`tests/suite/pg_processes.rs`,
//! `tests/suite/mysql.rs`): claims keys `0..keys` in transactional mode, each body
//! writing one row to `<namespace>.effects`, and prints how many bodies it ran.
//!
//! Usage: `idem-race-worker <url> <namespace> <keys> <worker-id>`. On PostgreSQL the
//! namespace is a schema holding idem's table too; on MySQL it is the URL's database,
//! where idem's table has its default name.

use idem_runtime::{Idem, IdemError, TxStep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Claims every key in its own transaction on `$pool`, retrying a transaction that hit a
/// retryable store error (a deadlock, a lock timeout, a serialization failure), and
/// evaluates to the number of bodies this process ran. A macro, not a generic function:
/// the same code over each database's pool and transaction types.
macro_rules! race {
    ($pool:expr, $idem:expr, $insert:expr, $keys:expr, $worker:expr) => {{
        let tasks: Vec<_> = (0..$keys)
            .map(|key: u32| {
                let (pool, idem, insert, worker) = (
                    $pool.clone(),
                    $idem.clone(),
                    $insert.clone(),
                    $worker.to_owned(),
                );
                tokio::spawn(async move {
                    loop {
                        let mut tx = pool.begin().await?;
                        let op = idem
                            .operation("effect", &key)
                            .retain(std::time::Duration::from_secs(86_400))
                            .fingerprint_none();
                        let guard = match op.begin_tx::<_, bool, IdemError>(&mut tx).await {
                            Ok(TxStep::Replay(out)) => {
                                out?;
                                tx.commit().await?;
                                return Ok::<bool, BoxError>(false);
                            }
                            Ok(TxStep::Run(g)) => g,
                            Err(e) if e.is_retryable() => continue,
                            Err(e) => return Err(e.into()),
                        };
                        let out = sqlx::query(&insert)
                            .bind(i64::from(key))
                            .bind(&worker)
                            .execute(&mut *tx)
                            .await
                            .map(|_| true)
                            .map_err(|e| IdemError::Config {
                                message: e.to_string(),
                            });
                        match guard.finish(&mut tx, out).await {
                            Ok(ran) => {
                                tx.commit().await?;
                                return Ok(ran);
                            }
                            Err(e) if e.is_retryable() => continue,
                            Err(e) => return Err(e.into()),
                        }
                    }
                })
            })
            .collect();
        let mut ran = 0u32;
        for t in tasks {
            if t.await?.map_err(|e| e.to_string())? {
                ran += 1;
            }
        }
        ran
    }};
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, namespace, keys, worker] = args.as_slice() else {
        return Err("usage: idem-race-worker <url> <namespace> <keys> <worker-id>".into());
    };
    let keys: u32 = keys.parse()?;
    let ran = if url.starts_with("mysql:") || url.starts_with("mariadb:") {
        mysql(url, namespace, keys, worker).await?
    } else {
        postgres(url, namespace, keys, worker).await?
    };
    println!("RAN={ran}");
    Ok(())
}

#[cfg(feature = "postgres")]
async fn postgres(url: &str, schema: &str, keys: u32, worker: &str) -> Result<u32, BoxError> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await?;
    let idem = Idem::builder()
        .table(format!("{schema}.idem_operations"))
        .pool(pool.clone())
        .await?;
    let insert = format!("INSERT INTO {schema}.effects (key, worker) VALUES ($1, $2)");
    Ok(race!(pool, idem, insert, keys, worker))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_: &str, _: &str, _: u32, _: &str) -> Result<u32, BoxError> {
    Err("built without the `postgres` feature".into())
}

#[cfg(feature = "mysql")]
async fn mysql(url: &str, database: &str, keys: u32, worker: &str) -> Result<u32, BoxError> {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await?;
    let idem = Idem::from_pool(pool.clone()).await?;
    let insert = format!("INSERT INTO {database}.effects (`key`, worker) VALUES (?, ?)");
    Ok(race!(pool, idem, insert, keys, worker))
}

#[cfg(not(feature = "mysql"))]
async fn mysql(_: &str, _: &str, _: u32, _: &str) -> Result<u32, BoxError> {
    Err("built without the `mysql` feature".into())
}
