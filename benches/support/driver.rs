//! Runs a bench's subjects on concurrent tasks and times them: one run, and the rounds
//! in which the subjects alternate.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Res;
use super::config::Knobs;

/// One side of a comparison, as the driver calls it.
pub trait Driven: Send + Sync + 'static {
    /// What the calls do, and on which keys.
    type Phase: Copy + Send + 'static;
    /// What each task holds across its calls.
    type Held: Send;

    /// The next key index; keys are never reused within a table.
    fn seq(&self) -> &AtomicU64;

    /// What a task holds for its whole run, taken before its first call.
    fn hold(&self) -> impl Future<Output = Res<Self::Held>> + Send;

    /// One call: operation `i` of `phase`.
    fn call(
        &self,
        phase: Self::Phase,
        i: u64,
        held: &mut Self::Held,
    ) -> impl Future<Output = Res<()>> + Send;
}

pub enum Stop {
    After(Duration),
    Ops(u64),
}

/// Runs `phase` on `concurrency` tasks until `stop`; returns operations per second.
pub async fn drive<S: Driven>(
    subject: &Arc<S>,
    phase: S::Phase,
    concurrency: usize,
    stop: Stop,
) -> Res<f64> {
    let (deadline, limit) = match stop {
        Stop::After(d) => (Some(Instant::now() + d), None),
        Stop::Ops(n) => (None, Some(subject.seq().load(Ordering::Relaxed) + n)),
    };
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (subject, done) = (subject.clone(), done.clone());
            tokio::spawn(async move {
                let mut held = subject.hold().await?;
                while deadline.is_none_or(|d| Instant::now() < d) {
                    let i = subject.seq().fetch_add(1, Ordering::Relaxed);
                    if limit.is_some_and(|l| i >= l) {
                        break;
                    }
                    subject.call(phase, i, &mut held).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Res::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    if let Some(limit) = limit {
        // The indices fetched past the limit ran nothing: the next run starts there.
        subject.seq().store(limit, Ordering::Relaxed);
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A subject measured in one row, named for the report.
pub type Contender<S> = (&'static str, Arc<S>, <S as Driven>::Phase);

/// Each subject in turn (idem, baseline, idem, baseline, ...), after a short warm-up of
/// each; the rounds of each subject.
pub async fn rounds<S: Driven>(
    knobs: &Knobs,
    subjects: &[Contender<S>],
    concurrency: usize,
) -> Res<Vec<(&'static str, Vec<f64>)>> {
    let warm = Duration::from_millis(300);
    for (_, subject, phase) in subjects {
        drive(subject, *phase, concurrency, Stop::After(warm)).await?;
    }
    let mut out: Vec<_> = subjects.iter().map(|s| (s.0, Vec::new())).collect();
    for _ in 0..knobs.rounds {
        for ((_, subject, phase), (_, out)) in subjects.iter().zip(&mut out) {
            out.push(drive(subject, *phase, concurrency, Stop::After(knobs.measure)).await?);
        }
    }
    Ok(out)
}
