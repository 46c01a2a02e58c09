//! Steps against separate operations: a checkout of two effects written as one
//! operation with two steps, beside the same two effects written as two idempotent
//! operations, and beside one operation with no step (the cost of the claim and the
//! record alone). Fresh keys throughout, the effects themselves free, so the rows
//! compare what idem does around them: a two-step operation is a claim, two step
//! records and the final record; two operations are two claims and two records.
//!
//! On PostgreSQL (`IDEM_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`,
//! idem's own 16 connections), a SQLite file, and the memory store, at 1 and 16 callers.
//! `IDEM_BENCH_SECS` (one measurement, default 2) and `IDEM_BENCH_ROUNDS` (rounds,
//! default 3); rows are medians of the rounds, the subjects alternating within each.
//!
//! `cargo bench -p idem-tests --bench steps`

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use idem_runtime::{Idem, IdemError, step};

// Shared with `pg` and `mysql`, which use all of it; this bench needs only the driver.
#[allow(dead_code)]
mod support;
use support::Res;
use support::config::Knobs;
use support::driver::{Contender, Driven, median, rounds};

const DAY: Duration = Duration::from_secs(86_400);

/// How a checkout's two effects are written.
#[derive(Clone, Copy)]
enum Shape {
    /// One operation, no step: the floor of one claim and one record.
    OneOperation,
    /// One operation whose body runs two steps.
    TwoSteps,
    /// Two operations, one per effect.
    TwoOperations,
}

struct Checkout {
    idem: Idem,
    seq: AtomicU64,
}

/// An effect that costs nothing: the rows measure idem around it.
async fn effect(n: u64) -> Result<u64, IdemError> {
    Ok(n)
}

impl Driven for Checkout {
    type Phase = Shape;
    type Held = ();

    fn seq(&self) -> &AtomicU64 {
        &self.seq
    }

    async fn hold(&self) -> Res<()> {
        Ok(())
    }

    async fn call(&self, shape: Shape, i: u64, _: &mut ()) -> Res<()> {
        let op = |name: &str| self.idem.operation(name, &i).retain(DAY).fingerprint_none();
        match shape {
            Shape::OneOperation => {
                op("checkout").run(|| effect(i)).await?;
            }
            Shape::TwoSteps => {
                op("checkout")
                    .run(|| async move {
                        let paid = step("charge", || effect(i)).await?;
                        step("ship", || effect(paid + 1)).await
                    })
                    .await?;
            }
            Shape::TwoOperations => {
                let paid = op("charge").run(|| effect(i)).await?;
                op("ship").run(|| effect(paid + 1)).await?;
            }
        }
        Ok(())
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let knobs = Knobs::from_env(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let dir = tempfile::tempdir()?;
    let table = format!("idem_bench_steps_{}", std::process::id());
    let stores: Vec<(&str, Idem)> = vec![
        (
            "PostgreSQL",
            Idem::builder()
                .table(table.as_str())
                .replay_cache_bytes(0)
                .postgres(&knobs.url)
                .await?,
        ),
        (
            "SQLite file",
            Idem::sqlite(&format!(
                "sqlite://{}",
                dir.path().join("steps.db").display()
            ))
            .await?,
        ),
        ("memory", Idem::memory()),
    ];
    println!(
        "| store | callers | one operation, no step (ops/s) | one operation, two steps | two operations | two steps / two operations |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (store, idem) in &stores {
        let subject = Arc::new(Checkout {
            idem: idem.clone(),
            seq: AtomicU64::new(0),
        });
        for callers in [1, 16] {
            let contenders: Vec<Contender<Checkout>> = vec![
                ("one", subject.clone(), Shape::OneOperation),
                ("steps", subject.clone(), Shape::TwoSteps),
                ("two", subject.clone(), Shape::TwoOperations),
            ];
            let got = rounds(&knobs, &contenders, callers).await?;
            let [one, steps, two] = [0, 1, 2].map(|i| median(&got[i].1));
            println!(
                "| {store} | {callers} | {one:.0} | {steps:.0} | {two:.0} | {:.2} |",
                steps / two
            );
        }
    }
    let pool = sqlx::PgPool::connect(&knobs.url).await?;
    for t in [
        format!("{table}_steps"),
        format!("{table}_meta"),
        table.clone(),
    ] {
        sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(&pool)
            .await?;
    }
    sqlx::query(&format!("DROP SEQUENCE IF EXISTS {table}_epoch_seq"))
        .execute(&pool)
        .await?;
    Ok(())
}
