//! A second OS process for `tests/pg_processes.rs`: claims keys `0..keys` in
//! transactional mode, each body writing one row to `<schema>.effects`, and prints how
//! many bodies it ran.
//!
//! Usage: `idem-race-worker <postgres-url> <schema> <keys> <worker-id>`.

use idem_runtime::{Idem, IdemError, TxStep};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, schema, keys, worker] = args.as_slice() else {
        return Err("usage: idem-race-worker <postgres-url> <schema> <keys> <worker-id>".into());
    };
    let keys: u32 = keys.parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(url)
        .await?;
    let idem = Idem::builder()
        .table(format!("{schema}.idem_operations"))
        .pool(pool.clone())
        .await?;
    let insert = format!("INSERT INTO {schema}.effects (key, worker) VALUES ($1, $2)");
    let mut ran = 0u32;
    let tasks: Vec<_> = (0..keys)
        .map(|key| {
            let (pool, idem, insert, worker) =
                (pool.clone(), idem.clone(), insert.clone(), worker.clone());
            tokio::spawn(async move {
                loop {
                    let mut tx = pool.begin().await?;
                    let op = idem.operation("effect", &key);
                    let guard = match op.begin_tx::<_, bool, IdemError>(&mut tx).await {
                        Ok(TxStep::Replay(out)) => {
                            out?;
                            tx.commit().await?;
                            return Ok::<bool, Box<dyn std::error::Error + Send + Sync>>(false);
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
    for t in tasks {
        if t.await?.map_err(|e| e.to_string())? {
            ran += 1;
        }
    }
    println!("RAN={ran}");
    Ok(())
}
