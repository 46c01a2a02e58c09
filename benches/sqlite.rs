//! SQLite group commit: idem's fresh calls on a SQLite file (WAL, `synchronous=FULL`) at
//! 1, 16 and 64 callers, and the writes each shared transaction carried, read from the
//! `idem_group_commit_writes` histogram; beside the floor of one caller, two bare
//! commits through sqlx on the same kind of file (a fresh call commits twice: the claim,
//! then the record).
//!
//! `IDEM_BENCH_SECS` (one measurement, default 2) and `IDEM_BENCH_ROUNDS` (rounds,
//! default 3); rows are medians of the rounds, the subjects alternating within each.
//!
//! `cargo bench -p idem-tests --bench sqlite`

use std::str::FromStr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_runtime::{Idem, IdemError};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous};

// Shared with `pg` and `mysql`, which use all of it; this bench needs only the driver.
#[allow(dead_code)]
mod support;
use support::Res;
use support::config::Knobs;
use support::driver::{Contender, Driven, Stop, drive, median, rounds};

const DAY: Duration = Duration::from_secs(86_400);

/// What a subject's calls write.
#[derive(Clone, Copy)]
enum Writes {
    /// idem's fresh calls.
    Idem,
    /// Two transactions of one insert each, through sqlx: what one caller's fresh call
    /// cannot go below.
    TwoCommits,
}

struct Subject {
    idem: Idem,
    bare: SqlitePool,
    seq: AtomicU64,
}

impl Driven for Subject {
    type Phase = Writes;
    type Held = ();

    fn seq(&self) -> &AtomicU64 {
        &self.seq
    }

    async fn hold(&self) -> Res<()> {
        Ok(())
    }

    async fn call(&self, writes: Writes, i: u64, _: &mut ()) -> Res<()> {
        match writes {
            Writes::Idem => {
                self.idem
                    .operation("charge", &i)
                    .retain(DAY)
                    .fingerprint_none()
                    .run(|| async move { Ok::<_, IdemError>(i) })
                    .await?;
            }
            Writes::TwoCommits => {
                for half in 0..2 {
                    sqlx::query("INSERT INTO bare (id, half) VALUES (?, ?)")
                        .bind(i as i64)
                        .bind(half)
                        .execute(&self.bare)
                        .await?;
                }
            }
        }
        Ok(())
    }
}

fn recorder() -> &'static Snapshotter {
    static SNAP: OnceLock<Snapshotter> = OnceLock::new();
    SNAP.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only recorder of this bench");
        snapshotter
    })
}

/// Batches and writes recorded since the last call.
fn batches() -> (usize, f64) {
    let mut out = (0, 0.0);
    for (key, _, _, value) in recorder().snapshot().into_vec() {
        if let (idem_runtime::metrics::BATCH_WRITES, DebugValue::Histogram(samples)) =
            (key.key().name(), value)
        {
            out.0 += samples.len();
            out.1 += samples.iter().map(|s| s.into_inner()).sum::<f64>();
        }
    }
    out
}

fn main() -> Res<()> {
    recorder();
    support::block_on(bench())
}

async fn bench() -> Res<()> {
    // Only the durations and rounds: the files are the bench's own.
    let knobs = Knobs::from_env("", "");
    let dir = tempfile::tempdir()?;
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .sqlite(&format!(
            "sqlite://{}",
            dir.path().join("idem.db").display()
        ))
        .await?;
    // The same journal and sync settings as idem's own file.
    let bare = SqlitePool::connect_with(
        SqliteConnectOptions::from_str(&format!(
            "sqlite://{}",
            dir.path().join("bare.db").display()
        ))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full),
    )
    .await?;
    sqlx::query("CREATE TABLE bare (id INTEGER NOT NULL, half INTEGER NOT NULL)")
        .execute(&bare)
        .await?;
    let subject = Arc::new(Subject {
        idem,
        bare,
        seq: AtomicU64::new(0),
    });
    println!(
        "| callers | idem fresh ops/s | vs 1 caller | writes per commit | two bare commits ops/s (1 caller) | idem / that |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut one = f64::NAN;
    for callers in [1, 16, 64] {
        let contenders: Vec<Contender<Subject>> = vec![
            ("idem", subject.clone(), Writes::Idem),
            ("bare", subject.clone(), Writes::TwoCommits),
        ];
        let got = rounds(
            &knobs,
            &contenders[..if callers == 1 { 2 } else { 1 }],
            callers,
        )
        .await?;
        let rate = median(&got[0].1);
        // One more measurement of idem alone, to read the batches it wrote.
        batches();
        drive(&subject, Writes::Idem, callers, Stop::After(knobs.measure)).await?;
        let (n, writes) = batches();
        if callers == 1 {
            one = rate;
            let floor = median(&got[1].1);
            println!(
                "| 1 | {rate:.0} | 1.00 | {:.2} | {floor:.0} | {:.2} |",
                writes / n as f64,
                rate / floor
            );
        } else {
            println!(
                "| {callers} | {rate:.0} | {:.2} | {:.2} | | |",
                rate / one,
                writes / n as f64
            );
        }
    }
    Ok(())
}
