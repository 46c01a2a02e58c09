//! A soak on PostgreSQL: 64 callers for a while mixing fresh keys, replays, racing
//! duplicates, cancelled calls and released errors through one `Idem::postgres`, with
//! what the process and the server hold sampled every few seconds into a table: alive
//! tokio tasks, connections to the database (idem's own, and all of it), open file
//! descriptors and resident memory. Whatever idem leaks under sustained load shows as a
//! column that keeps growing; the last row is taken after the callers stopped.
//!
//! `cargo bench -p idem-tests --bench soak -- --secs 60` (PostgreSQL at
//! `IDEM_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`). `--secs N`
//! sets the load's length (default 60), `--every N` the seconds between samples
//! (default 5).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::{Idem, IdemError};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "support/fill.rs"]
#[allow(dead_code)]
mod fill;

const CALLERS: usize = 64;
/// Keys each caller remembers for its replays.
const REMEMBERED: usize = 64;
/// Duplicates released together on one key in a race.
const RACERS: usize = 4;
/// The `application_name` of idem's connections, to count them apart from others'.
const APP: &str = "idem-soak";

/// What a body returns when it declines: released, so a retry runs again.
#[derive(Debug)]
enum CallError {
    Idem(IdemError),
    Declined,
}

impl From<IdemError> for CallError {
    fn from(e: IdemError) -> Self {
        CallError::Idem(e)
    }
}

/// Calls of each kind made, and what went wrong.
#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    fresh: AtomicU64,
    replays: AtomicU64,
    races: AtomicU64,
    cancelled: AtomicU64,
    released: AtomicU64,
    /// A replay that returned another outcome, a race that ran its body twice, or a
    /// retry after a release that did not run again.
    wrong: AtomicU64,
    /// Store errors and anything unexpected.
    errors: AtomicU64,
}

/// One caller's deterministic choices (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) % n
    }
}

/// A call under `key` whose body counts its runs in `runs`, waits `work`, and returns
/// `value`, or declines.
async fn call(
    idem: &Idem,
    key: &str,
    value: u64,
    work: Duration,
    decline: bool,
    runs: &AtomicUsize,
) -> Result<u64, CallError> {
    idem.operation("soak", key)
        .lease(Duration::from_secs(5))
        .retain(Duration::from_secs(600))
        .fingerprint(&value)
        .run(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            if !work.is_zero() {
                tokio::time::sleep(work).await;
            }
            if decline {
                Err(CallError::Declined)
            } else {
                Ok(value)
            }
        })
        .await
}

/// One caller's loop until `until`.
async fn caller(idem: Idem, me: usize, until: Instant, counts: Arc<Counts>) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (me as u64 + 1));
    let mut done: Vec<(String, u64)> = Vec::with_capacity(REMEMBERED);
    let mut n = 0u64;
    let bad = |c: &Counts, e: &dyn std::fmt::Debug| {
        // The first few are printed; the count is in the summary.
        if c.errors.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!("caller {me}: {e:?}");
        }
    };
    while Instant::now() < until {
        n += 1;
        let key = format!("c{me}-{n}");
        let runs = AtomicUsize::new(0);
        let roll = rng.below(100);
        counts.calls.fetch_add(1, Ordering::Relaxed);
        match roll {
            // A fresh key.
            0..=44 => match call(&idem, &key, n, Duration::ZERO, false, &runs).await {
                Ok(_) => {
                    counts.fresh.fetch_add(1, Ordering::Relaxed);
                    if done.len() == REMEMBERED {
                        done.remove(0);
                    }
                    done.push((key, n));
                }
                Err(e) => bad(&counts, &e),
            },
            // A retry of a key this caller completed.
            45..=69 if !done.is_empty() => {
                let (key, value) = &done[rng.below(done.len() as u64) as usize];
                match call(&idem, key, *value, Duration::ZERO, false, &runs).await {
                    Ok(v) if v == *value && runs.load(Ordering::SeqCst) == 0 => {
                        counts.replays.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        counts.wrong.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => bad(&counts, &e),
                }
            }
            // Duplicates released together on a new key: one body runs.
            70..=79 => {
                let runs = Arc::new(runs);
                let racers: Vec<_> = (0..RACERS)
                    .map(|_| {
                        let (idem, key, runs) = (idem.clone(), key.clone(), runs.clone());
                        tokio::spawn(async move {
                            call(&idem, &key, n, Duration::from_millis(2), false, &runs).await
                        })
                    })
                    .collect();
                let mut ok = true;
                for racer in racers {
                    match racer.await {
                        Ok(Ok(v)) if v == n => {}
                        Ok(Ok(_)) => ok = false,
                        Ok(Err(CallError::Idem(IdemError::InFlight { .. }))) => {}
                        Ok(Err(e)) => bad(&counts, &e),
                        Err(e) => bad(&counts, &e),
                    }
                }
                if ok && runs.load(Ordering::SeqCst) == 1 {
                    counts.races.fetch_add(1, Ordering::Relaxed);
                } else {
                    counts.wrong.fetch_add(1, Ordering::Relaxed);
                }
            }
            // A caller that goes away mid-body: its claim stays until the lease lapses.
            80..=89 => {
                let cut = call(&idem, &key, n, Duration::from_millis(50), false, &runs);
                if tokio::time::timeout(Duration::from_millis(5), cut)
                    .await
                    .is_err()
                {
                    counts.cancelled.fetch_add(1, Ordering::Relaxed);
                }
            }
            // A released error, then its retry, which runs the body again.
            _ => match call(&idem, &key, n, Duration::ZERO, true, &runs).await {
                Err(CallError::Declined) => {
                    match call(&idem, &key, n, Duration::ZERO, false, &runs).await {
                        Ok(v) if v == n && runs.load(Ordering::SeqCst) == 2 => {
                            counts.released.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {
                            counts.wrong.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => bad(&counts, &e),
                    }
                }
                Ok(_) => {
                    counts.wrong.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => bad(&counts, &e),
            },
        }
    }
}

/// What the process and the server hold at one moment.
struct Sample {
    at: Duration,
    calls: u64,
    tasks: usize,
    idem_conns: i64,
    db_conns: i64,
    fds: usize,
    rss_bytes: u64,
}

async fn sample(admin: &sqlx::PgPool, start: Instant, counts: &Counts, page: u64) -> Res<Sample> {
    let (idem_conns, db_conns): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE application_name = $1), count(*) \
         FROM pg_stat_activity WHERE datname = current_database()",
    )
    .bind(APP)
    .fetch_one(admin)
    .await?;
    // The listing's own handle on the folder is one of them.
    let fds = std::fs::read_dir("/proc/self/fd")?
        .count()
        .saturating_sub(1);
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let resident: u64 = statm
        .split_whitespace()
        .nth(1)
        .ok_or("no resident size in /proc/self/statm")?
        .parse()?;
    Ok(Sample {
        at: start.elapsed(),
        calls: counts.calls.load(Ordering::Relaxed),
        tasks: tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks(),
        idem_conns,
        db_conns,
        fds,
        rss_bytes: resident * page,
    })
}

fn print_header() {
    println!("| t (s) | calls/s | tasks | idem conns | db conns | fds | RSS (MiB) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
}

fn print_row(label: &str, s: &Sample, prev: Option<&Sample>) {
    let rate = prev.map_or("".to_owned(), |p| {
        let secs = (s.at - p.at).as_secs_f64();
        format!("{:.0}", (s.calls - p.calls) as f64 / secs)
    });
    println!(
        "| {label} | {rate} | {} | {} | {} | {} | {:.1} |",
        s.tasks,
        s.idem_conns,
        s.db_conns,
        s.fds,
        s.rss_bytes as f64 / (1024.0 * 1024.0)
    );
}

/// `--name N` from the arguments (cargo adds `--bench`, which is ignored).
fn arg(name: &str, default: u64) -> Res<u64> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or_else(|| format!("{name} needs a number"))?
            .parse()?),
        None => Ok(default),
    }
}

fn page_size() -> u64 {
    std::process::Command::new("getconf")
        .arg("PAGESIZE")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096)
}

#[tokio::main]
async fn main() -> Res<()> {
    let secs = arg("--secs", 60)?;
    let every = arg("--every", 5)?.max(1);
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let sep = if url.contains('?') { '&' } else { '?' };
    let idem_url = format!("{url}{sep}application_name={APP}");
    let table = format!("idem_soak_{}", std::process::id());
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await?;
    let idem = Idem::builder().table(&table).postgres(&idem_url).await?;
    let page = page_size();
    let counts = Arc::new(Counts::default());
    println!(
        "soak: {CALLERS} callers for {secs}s on PostgreSQL, sampled every {every}s \
         (table {table})"
    );
    print_header();
    let start = Instant::now();
    let mut prev = sample(&admin, start, &counts, page).await?;
    print_row("0", &prev, None);
    let until = start + Duration::from_secs(secs);
    let callers: Vec<_> = (0..CALLERS)
        .map(|me| tokio::spawn(caller(idem.clone(), me, until, counts.clone())))
        .collect();
    let mut next = start + Duration::from_secs(every);
    while next <= until {
        tokio::time::sleep_until(next.into()).await;
        let now = sample(&admin, start, &counts, page).await?;
        print_row(&format!("{:.0}", now.at.as_secs_f64()), &now, Some(&prev));
        prev = now;
        next += Duration::from_secs(every);
    }
    for c in callers {
        c.await?;
    }
    // After the load: what stays held once the callers are gone.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let end = sample(&admin, start, &counts, page).await?;
    print_row("idle +2s", &end, None);
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "\n{} calls: {} fresh, {} replays, {} races of {RACERS}, {} cancelled mid-body, {} \
         released then retried; {} wrong outcomes, {} errors",
        c(&counts.calls),
        c(&counts.fresh),
        c(&counts.replays),
        c(&counts.races),
        c(&counts.cancelled),
        c(&counts.released),
        c(&counts.wrong),
        c(&counts.errors)
    );
    drop(idem);
    fill::drop_idem_table(&admin, &table).await?;
    if c(&counts.wrong) > 0 {
        return Err("some calls got a wrong outcome".into());
    }
    Ok(())
}
