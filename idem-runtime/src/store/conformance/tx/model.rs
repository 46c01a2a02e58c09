//! The transactional model check: random schedules of callers that commit, roll back,
//! fail or are cancelled, checked for one committed body per key.

use std::sync::Arc;
use std::time::Duration;

use super::{Failure, TxDatabase, TxTarget, fresh};
use crate::TxStep;

/// The seeds [`model_random_schedules`] runs: `IDEM_MODEL_SEED` replays one,
/// `IDEM_MODEL_RUNS` runs that many (3 by default).
pub fn model_seeds() -> Vec<u64> {
    if let Ok(seed) = std::env::var("IDEM_MODEL_SEED") {
        return vec![seed.parse().expect("IDEM_MODEL_SEED is a number")];
    }
    let runs = std::env::var("IDEM_MODEL_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    (1..=runs).collect()
}

/// Random schedules of transactional calls on a few keys, one per seed of
/// [`model_seeds`]: callers commit or roll back, bodies fail with a released error,
/// roll back to idem's own savepoint, or are cancelled mid-way. Whatever the
/// schedule, each key commits at most one body's writes, and every committed `Ok`
/// answer is that body's value.
pub async fn model_random_schedules<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    let seeds = model_seeds();
    for &seed in &seeds {
        model_schedule(t, seed).await;
    }
    use std::io::Write;
    // Uncaptured, so a passing run says which seeds it covered.
    let _ = writeln!(
        std::io::stderr(),
        "transactional model on {}: {} schedules of 4 callers x 8 steps passed, seeds {seeds:?}",
        DB::NAME,
        seeds.len()
    );
}

async fn model_schedule<DB>(t: &TxTarget<DB>, seed: u64)
where
    DB: TxDatabase,
{
    let base = fresh(&format!("m{seed}"));
    // (key, value answered, whether the caller committed)
    let answers = Arc::new(std::sync::Mutex::new(Vec::<(String, i64, bool)>::new()));
    let callers: Vec<_> = (0..4u64)
        .map(|caller| {
            let (t, base, answers) = (t.clone(), base.clone(), answers.clone());
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(seed * 100 + caller);
                for step in 0..8u64 {
                    let key = format!("{base}k{}", rng.u32(0..3));
                    let behavior = rng.u32(0..100);
                    let cancel_after = Duration::from_micros(rng.u64(0..3000));
                    let cancellable = (90..100).contains(&behavior);
                    let mut tx = if cancellable {
                        t.begin_cancellable().await
                    } else {
                        t.begin().await
                    };
                    let op = t
                        .idem
                        .operation("tx_model", key.as_str())
                        .fingerprint_none()
                        .retain(Duration::from_secs(3600))
                        .lease(Duration::from_millis(300));
                    let value = (caller * 100 + step) as i64;
                    let call = async {
                        let guard = match op.begin_tx::<_, i64, Failure>(DB::tx(&mut tx)).await? {
                            TxStep::Replay(out) => return out,
                            TxStep::Run(g) => g,
                        };
                        let undo = format!("ROLLBACK TO SAVEPOINT {}", guard.savepoint());
                        let body = async {
                            if (60..70).contains(&behavior) {
                                // The body undoes idem's claim along with its own work.
                                DB::execute(&mut *tx, undo)
                                    .await
                                    .map_err(|e| Failure::Declined(e.to_string()))?;
                            }
                            let id = format!("{key}#{caller}#{step}");
                            t.insert(&mut tx, &id, value)
                                .await
                                .map_err(|e| Failure::Declined(e.to_string()))?;
                            if (40..60).contains(&behavior) {
                                return Err(Failure::Timeout);
                            }
                            Ok(value)
                        }
                        .await;
                        guard.finish(DB::tx(&mut tx), body).await
                    };
                    let out = if cancellable {
                        match tokio::time::timeout(cancel_after, call).await {
                            Ok(out) => out,
                            Err(_) => {
                                (t.abandon)(tx).await;
                                continue;
                            }
                        }
                    } else {
                        call.await
                    };
                    // A caller keeps its transaction only for a success or the
                    // released error the contract lets it commit after; 70..90 roll
                    // back whatever the answer.
                    let commit = matches!(out, Ok(_) | Err(Failure::Timeout))
                        && !(70..90).contains(&behavior)
                        && !cancellable;
                    let committed = if commit {
                        tx.commit().await.is_ok()
                    } else {
                        let _ = tx.rollback().await;
                        false
                    };
                    if let Ok(v) = out {
                        answers.lock().unwrap().push((key, v, committed));
                    }
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    let mut by_key = std::collections::HashMap::<String, Vec<i64>>::new();
    let sql = format!("SELECT id, qty FROM {} WHERE id LIKE '{base}k%'", t.table);
    for (id, qty) in DB::rows(&t.pool, sql).await.unwrap() {
        let key = id.split('#').next().unwrap().to_owned();
        by_key.entry(key).or_default().push(qty);
    }
    let mut violations = Vec::new();
    for (key, values) in &by_key {
        if values.len() > 1 {
            violations.push(format!(
                "key {key} committed {} bodies' writes: {values:?}",
                values.len()
            ));
        }
    }
    for (key, v, committed) in answers.lock().unwrap().iter() {
        let written = by_key.get(key).map(Vec::as_slice).unwrap_or(&[]);
        if *committed && written != [*v] {
            violations.push(format!(
                "key {key} answered {v} and committed, but its writes are {written:?}"
            ));
        }
    }
    assert!(
        violations.is_empty(),
        "transactional model on {}, seed {seed} (rerun with IDEM_MODEL_SEED={seed}):\n{}",
        DB::NAME,
        violations.join("\n")
    );
}
