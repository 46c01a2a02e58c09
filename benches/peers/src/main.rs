//! idem beside its peers, measured in one run: the `idempotent` crate 0.3.0 (its memory
//! store and its Valkey store) doing the same work, and on the same Redis server its
//! floors: `redis-benchmark`'s SET/GET, two trivial scripts per call through idem's
//! Redis client (the best a design of two scripts per fresh call can do), one per call
//! (the best a replay of one round trip can do), and idem's commands sent with nothing
//! decided: a fresh call's two scripts with their logic taken out, and the replay's read
//! (what idem's commands cost by themselves). `IDEM_BENCH_COMMANDS=1` also counts the
//! server's commands and their time per call under 16 callers, for each library and for
//! idem's commands issued without its scripts' logic.
//!
//! ```text
//! cargo build --release --manifest-path benches/peers/Cargo.toml
//! taskset -c 0 "${CARGO_TARGET_DIR:-benches/peers/target}/release/idem-peer-bench"
//! ```
//!
//! The work, for both libraries: fingerprint a small request, claim its key, run a body
//! that returns a small receipt at once, record the receipt; a replay claims a recorded
//! key and decodes the receipt. The peer hashes the request's JSON bytes (it takes
//! bytes); idem fingerprints the value itself. The bench starts its own `redis-server`
//! on a spare 127.0.0.1 port, pinned to core 1 with `taskset` when the machine has two
//! cores, so run the client on core 0 as above; it stops the server at the end.
//! Each figure is the median over `--rounds` rounds, the systems interleaved within
//! each round, so drift on a noisy machine hits them alike.

use std::alloc::{GlobalAlloc, Layout, System};

use std::future::Future;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use idem_peer_bench::{Res, Size, idem_call, idem_call_of, peer_call_sized, peer_memory};
use idem_runtime::Idem;
use idem_runtime::store::{Delegate, MemoryStore, Store};
use idempotent::store::IdempotencyStore;

type Call = Arc<dyn Fn(u64) -> Pin<Box<dyn Future<Output = Res<()>> + Send>> + Send + Sync>;

/// Counts live heap bytes, for memory per stored record, and their peak while asked.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static TRACK_PEAK: AtomicBool = AtomicBool::new(false);

/// Raises the peak to `live` while a peak is being measured (one load otherwise).
fn note(live: isize) {
    if TRACK_PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counter only
// observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let size = layout.size() as isize;
        note(LIVE.fetch_add(size, Ordering::Relaxed) + size);
        // SAFETY: the caller's layout contract is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grow = new_size as isize - layout.size() as isize;
        note(LIVE.fetch_add(grow, Ordering::Relaxed) + grow);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[derive(Parser)]
#[command(about = "idem beside the `idempotent` crate and redis-benchmark, in one run")]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    /// Rounds; each figure is the median.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Records stored for the memory-per-record figure.
    #[arg(long, default_value_t = 100_000)]
    records: u64,
    /// Skip the Redis half (no redis-server needed).
    #[arg(long)]
    no_redis: bool,
    /// Skip the in-process half.
    #[arg(long)]
    redis_only: bool,
    /// Only the replay cache on against off, in front of a store with a round trip.
    #[arg(long)]
    cache_only: bool,
    /// Only measure the systems whose name is this (e.g. `idem`, `idempotent`).
    #[arg(long)]
    only: Option<String>,
    /// Only run this many fresh idem memory-store calls on one thread, for a profiler:
    /// `valgrind --tool=callgrind ... --profile 20000`.
    #[arg(long)]
    profile: Option<u64>,
    /// With `--profile`: replay those calls this many times over after recording them.
    #[arg(long, default_value_t = 0)]
    profile_replays: u64,
    /// With `--profile`: the memory store behind a round trip, with the replay cache
    /// (`on`) or without (`off`), instead of the memory store itself.
    #[arg(long)]
    profile_cache: Option<Switch>,
    /// With `--cache-only` or `--profile-cache on`: the replay cache's budget in bytes,
    /// instead of its default (4 MiB).
    #[arg(long, value_name = "BYTES")]
    cache_bytes: Option<usize>,
}

/// `--cache-bytes`, for the systems built by plain functions.
static CACHE_BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Keys recorded before a replay phase; replays cycle through them.
const REPLAY_KEYS: u64 = 2_000;

/// Operations per second of `call` with `callers` tasks for `secs`; keys from `base` up,
/// or cycling through `cycle` keys from `base` when it is set (replays).
async fn rate(call: &Call, callers: usize, secs: f64, base: u64, cycle: Option<u64>) -> Res<f64> {
    let next = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..callers {
        let (call, next) = (call.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let key = match cycle {
                    Some(m) => base + i % m,
                    None => base + i,
                };
                call(key).await?;
                n += 1;
            }
            Res::Ok(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One row of the report: a label and its samples.
struct Row {
    label: String,
    samples: Vec<f64>,
}

fn idem_calls(idem: Idem) -> Call {
    idem_calls_of(idem, Size::Small, true)
}

/// idem's calls with a request of `size`, fingerprinted or not.
fn idem_calls_of(idem: Idem, size: Size, fingerprinted: bool) -> Call {
    Arc::new(move |k| {
        let idem = idem.clone();
        Box::pin(async move { idem_call_of(&idem, k, size, fingerprinted).await })
    })
}

fn peer_calls<S: IdempotencyStore>(store: Arc<S>) -> Call {
    peer_calls_sized(store, Size::Small)
}

fn peer_calls_sized<S: IdempotencyStore>(store: Arc<S>, size: Size) -> Call {
    Arc::new(move |k| {
        let store = store.clone();
        Box::pin(async move { peer_call_sized(&*store, k, size).await })
    })
}

/// Fresh and replay rates for each system at each caller count, interleaved by round;
/// a floor's kind of call it does not make ([`measures`]) is left out.
async fn compare(
    systems: &[Measured],
    callers: &[usize],
    args: &Args,
    base: &AtomicU64,
) -> Res<Vec<Row>> {
    let systems: Vec<&Measured> = systems
        .iter()
        .filter(|s| args.only.as_deref().is_none_or(|o| o == s.name))
        .collect();
    let label = |name: &str, what: &str, c: usize| format!("{name} {what} ×{c}");
    let mut rows: Vec<Row> = Vec::new();
    for Measured { name, .. } in &systems {
        for &c in callers {
            for what in ["fresh", "replay"] {
                if measures(name, what) {
                    rows.push(Row {
                        label: label(name, what, c),
                        samples: Vec::new(),
                    });
                }
            }
        }
    }
    let mut sample = |name: &str, what: &str, c: usize, rate: f64| {
        let l = label(name, what, c);
        if let Some(row) = rows.iter_mut().find(|r| r.label == l) {
            row.samples.push(rate);
        }
    };
    for _ in 0..args.rounds {
        for Measured { name, call, empty } in &systems {
            for &c in callers {
                if measures(name, "fresh") {
                    let b = base.fetch_add(1 << 32, Ordering::Relaxed);
                    let fresh = empty.map_or_else(|| call.clone(), |empty| empty());
                    sample(name, "fresh", c, rate(&fresh, c, args.secs, b, None).await?);
                    drop(fresh);
                    trim_heap();
                }
                if measures(name, "replay") {
                    // Replays of keys recorded just before, untimed: a replay cache holds
                    // what this process recorded last, and the fresh calls above would
                    // have pushed out keys recorded any earlier.
                    let b = base.fetch_add(1 << 32, Ordering::Relaxed);
                    record_replay_keys(call, b).await?;
                    let replays = rate(call, c, args.secs, b, Some(REPLAY_KEYS)).await?;
                    sample(name, "replay", c, replays);
                }
            }
        }
    }
    Ok(rows)
}

/// Hands back to the system what a dropped store left free. A million records freed
/// leave glibc's heap in pieces, and a later free beside a large free piece stops to
/// merge them: without this, a measurement's speed would depend on the stores dropped
/// before it.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: `malloc_trim` only returns free memory to the system; no pointer the
    // program holds is touched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Live heap bytes per record: the growth while storing the second half of `n`
/// records, so the store's fixed costs and earlier phases' garbage are left out.
async fn bytes_per_record(call: &Call, n: u64, base: u64) -> Res<f64> {
    let half = n / 2;
    for k in 0..half {
        call(base + k).await?;
    }
    // Let background work (the peer's store task, idem's renewals) settle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = LIVE.load(Ordering::Relaxed);
    for k in half..n {
        call(base + k).await?;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = LIVE.load(Ordering::Relaxed);
    Ok((after - before) as f64 / (n - half) as f64)
}

/// Records the [`REPLAY_KEYS`] keys from `base` on, untimed, for replays to read.
async fn record_replay_keys(call: &Call, base: u64) -> Res<()> {
    for k in 0..REPLAY_KEYS {
        call(base + k).await?;
    }
    Ok(())
}

/// The peak of live heap above its level at the start, while `callers` tasks replay
/// the recorded keys for `secs`: what the calls in flight hold, stored records apart.
async fn replay_peak(call: &Call, callers: usize, secs: f64) -> Res<f64> {
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    TRACK_PEAK.store(true, Ordering::Relaxed);
    let done = rate(call, callers, secs, 0, Some(REPLAY_KEYS)).await;
    TRACK_PEAK.store(false, Ordering::Relaxed);
    done?;
    Ok((PEAK.load(Ordering::Relaxed) - start) as f64)
}

/// The floor of a design of two scripts on a fresh call: two trivial scripts in turn,
/// through the client idem uses (a `ConnectionManager` of the same `redis` crate), the
/// first writing one field of the call's key and the second reading it back. Without
/// `write`, the read alone: the floor of a replay of one script. `prefix` keeps its keys
/// apart.
async fn floor_calls(url: &str, prefix: &str, write: bool) -> Res<Call> {
    let conn = redis::aio::ConnectionManager::new(redis::Client::open(url)?).await?;
    let write = write.then(|| {
        Arc::new(redis::Script::new(
            "return redis.call('HSET', KEYS[1], 'v', ARGV[1])",
        ))
    });
    let read = Arc::new(redis::Script::new(
        "return redis.call('HGET', KEYS[1], 'v')",
    ));
    let prefix = prefix.to_owned();
    Ok(Arc::new(move |k| {
        let (mut conn, write, read) = (conn.clone(), write.clone(), read.clone());
        let key = format!("{prefix}:{{{k}}}");
        Box::pin(async move {
            if let Some(write) = write {
                let _: i64 = write.key(&key).arg(k).invoke_async(&mut conn).await?;
            }
            let _: Option<u64> = read.key(&key).invoke_async(&mut conn).await?;
            Ok(())
        })
    }))
}

/// idem's replay read with idem taken out: the `HMGET` of the three fields idem's
/// replay reads, with `time` followed by `TIME` in one pipeline (as a replay sends them
/// when no `TIME` was read in the last second), through one connection of the client
/// idem uses, its replies read into the same types and nothing decided. A key it finds
/// empty it fills, untimed, with fields of the sizes idem writes.
async fn read_command_floor_calls(url: &str, prefix: &str, time: bool) -> Res<Call> {
    let conn = redis::aio::ConnectionManager::new(redis::Client::open(url)?).await?;
    let prefix = prefix.to_owned();
    Ok(Arc::new(move |k| {
        let mut conn = conn.clone();
        let rec = format!("{prefix}:r:{{{k}}}");
        Box::pin(async move {
            let mut hmget = redis::cmd("HMGET");
            hmget.arg(&rec).arg(&["xa", "fp", "o"]);
            let fields: Vec<redis::Value> = if time {
                let mut pipe = redis::pipe();
                pipe.add_command(hmget).cmd("TIME");
                let (fields, _now): (Vec<redis::Value>, (i64, i64)) =
                    pipe.query_async(&mut conn).await?;
                fields
            } else {
                hmget.query_async(&mut conn).await?
            };
            if fields.first() == Some(&redis::Value::Nil) {
                let _: () = redis::cmd("HSET")
                    .arg(&rec)
                    .arg("s")
                    .arg("1")
                    .arg("xa")
                    .arg("4102444800000")
                    .arg("e")
                    .arg((1_796_000_000_000_000 + k).to_string())
                    .arg("fp")
                    .arg(&[7u8; 32][..])
                    .arg("o")
                    .arg(format!(
                        "0:1:{{\"id\":\"ch_{k}\",\"amount\":4200,\"currency\":\"eur\"}}"
                    ))
                    .query_async(&mut conn)
                    .await?;
            }
            Ok(())
        })
    }))
}

/// The floor's name in the report.
const FLOOR: &str = "two trivial scripts (floor)";

/// The name in the report of idem's fresh call with its scripts' logic taken out.
const COMMANDS: &str = "idem's commands alone";

/// The name in the report of idem's replay command with idem taken out: its `HMGET`.
const READ_COMMANDS: &str = "idem's replay commands alone";

/// The name in the report of the same `HMGET` and a `TIME`, as a replay sends them when
/// no `TIME` was read in the last second.
const READ_HMGET: &str = "its HMGET and TIME";

/// The replay floor's name in the report.
const READ_FLOOR: &str = "one trivial script (replay floor)";

/// Whether `name`'s `what` calls (`fresh` or `replay`) are a measure of their own. Each
/// floor makes one kind of call: the two-script floor's "replays" are its two scripts
/// again, the replay floors' "fresh" calls their read.
fn measures(name: &str, what: &str) -> bool {
    !([FLOOR, COMMANDS].contains(&name) && what == "replay"
        || [READ_FLOOR, READ_COMMANDS, READ_HMGET].contains(&name) && what == "fresh")
}

/// idem's fresh call with its scripts' logic taken out: two scripts that issue the
/// commands idem's claim and record issue on a new key, with arguments of the same
/// sizes, and decide nothing. Its server time per call is what idem's commands cost.
async fn command_floor_calls(url: &str, prefix: &str) -> Res<Call> {
    let conn = redis::aio::ConnectionManager::new(redis::Client::open(url)?).await?;
    let claim = Arc::new(redis::Script::new(
        "redis.call('TIME')
        redis.call('EXISTS', KEYS[1])
        redis.call('HSET', KEYS[1], 's', '0', 'e', ARGV[1], 'fp', ARGV[2], 'll', ARGV[3],
            'sn', ARGV[4], 'k', ARGV[5])
        return ARGV[1]",
    ));
    let record = Arc::new(redis::Script::new(
        "redis.call('HMGET', KEYS[1], 's', 'e', 'st', 'w')
        redis.call('HSET', KEYS[1], 's', '1', 'o', ARGV[1], 'xa', ARGV[2])
        redis.call('PEXPIRE', KEYS[1], ARGV[3])
        return 1",
    ));
    let prefix = prefix.to_owned();
    Ok(Arc::new(move |k| {
        let (mut conn, claim, record) = (conn.clone(), claim.clone(), record.clone());
        let (rec, steps) = (format!("{prefix}:r:{{{k}}}"), format!("{prefix}:s:{{{k}}}"));
        Box::pin(async move {
            let epoch = (1_796_000_000_000_000 + k).to_string();
            let _: i64 = claim
                .key(&rec)
                .key(&steps)
                .arg(epoch)
                .arg(&[7u8; 32][..])
                .arg("60002")
                .arg("5:bench6:charge")
                .arg(format!("order-{k}"))
                .invoke_async(&mut conn)
                .await?;
            let _: i64 = record
                .key(&rec)
                .key(&steps)
                .arg(format!(
                    "0:1:{{\"id\":\"ch_{k}\",\"amount\":4200,\"currency\":\"eur\"}}"
                ))
                .arg("1796086400000")
                .arg("86700000")
                .invoke_async(&mut conn)
                .await?;
            Ok(())
        })
    }))
}

/// Calls per system whose server-side commands `IDEM_BENCH_COMMANDS` counts: enough for
/// a steady time per script, few enough to stay a second or two.
const COUNTED_CALLS: u64 = 20_000;

/// Callers at once while the commands are counted: the server's time per command under
/// the load of the 16-caller rows. A lone caller's commands each find the server idle
/// and its caches cold, and their times move with that from run to run.
const COUNTED_CALLERS: u64 = 16;

/// The commands the server saw for `COUNTED_CALLS` fresh calls and as many replays of
/// each library, and as many calls of the floor.
async fn commands_per_op(url: &str) -> Res<()> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let idem = idem_calls(
        Idem::builder()
            .key_prefix("idem-count")
            .replay_cache_bytes(0)
            .redis(url)
            .await?,
    );
    let peer = peer_calls(Arc::new(
        idempotent::store::valkey::ValkeyStore::with_prefix(client.clone(), Some("count")).await?,
    ));
    let floor = floor_calls(url, "floor-count", true).await?;
    let commands = command_floor_calls(url, "commands-count").await?;
    for (name, call) in [
        ("idem", idem),
        ("idempotent", peer),
        ("floor", floor),
        (COMMANDS, commands),
    ] {
        for what in ["fresh", "replay"] {
            if name != "idem" && name != "idempotent" && what == "replay" {
                continue;
            }
            if what == "fresh" {
                // Each system's count starts on an empty server: the keys of the timed
                // rounds and of the systems counted before would otherwise grow its
                // table (and rehash it) under some counts and not others.
                let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;
            }
            let _: () = redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async(&mut conn)
                .await?;
            let callers: Vec<_> = (0..COUNTED_CALLERS)
                .map(|first| {
                    let call = call.clone();
                    tokio::spawn(async move {
                        for k in (first..COUNTED_CALLS).step_by(COUNTED_CALLERS as usize) {
                            call(1 << 50 | k).await?;
                        }
                        Res::Ok(())
                    })
                })
                .collect();
            for caller in callers {
                caller.await??;
            }
            let stats: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await?;
            let calls: Vec<String> = stats
                .lines()
                .filter_map(|l| l.strip_prefix("cmdstat_"))
                .map(|l| {
                    // name:calls=N,usec=U,usec_per_call=P,...: keep the name, N and P.
                    let name = l.split(':').next().unwrap_or(l);
                    let field = |f: &str| {
                        l.split([':', ','])
                            .find_map(|kv| kv.strip_prefix(f))
                            .unwrap_or("?")
                            .to_owned()
                    };
                    format!(
                        "{name}×{} ({} µs)",
                        field("calls="),
                        field("usec_per_call=")
                    )
                })
                .filter(|l| !l.starts_with("config") && !l.starts_with("info"))
                .collect();
            println!(
                "- {name} {what}, {COUNTED_CALLS} calls: {}",
                calls.join(" ")
            );
        }
    }
    Ok(())
}

/// A redis-server of the bench's own on a spare port, stopped on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the machine has a second core for the server: counted with `nproc --all`,
/// since `available_parallelism` counts only the cores this process may use, one under
/// `taskset -c 0`.
fn two_cores() -> bool {
    number_from("nproc", "--all").is_some_and(|n| n >= 2.0)
        && Command::new("taskset").arg("-V").output().is_ok()
}

/// The number `program arg` prints, if it runs and prints one.
fn number_from(program: &str, arg: &str) -> Option<f64> {
    let out = Command::new(program).arg(arg).output().ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

fn start_redis() -> Res<Server> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let server_args = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    .map(String::from);
    let mut cmd = if two_cores() {
        let mut c = Command::new("taskset");
        c.args(["-c", "1", "redis-server"]);
        c
    } else {
        Command::new("redis-server")
    };
    let child = cmd
        .args(&server_args)
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("start redis-server (is it on the PATH?): {e}"))?;
    let server = Server { child, port };
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(server);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("redis-server did not listen on 127.0.0.1:{port}").into())
}

/// redis-benchmark's SET and GET requests per second at `clients`.
fn redis_floor(port: u16, clients: usize, secs: f64) -> Res<(f64, f64)> {
    // About `secs` seconds at a rate near 50k/s per client pair, at least 20k requests.
    let n = ((secs * 30_000.0) as u64).max(20_000);
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &clients.to_string(), "-n", &n.to_string()])
        .args(["-r", "100000", "-t", "set,get", "--csv"])
        .output()
        .map_err(|e| format!("run redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |test: &str| -> Res<f64> {
        text.lines()
            .find(|l| l.starts_with(&format!("\"{test}\"")))
            .and_then(|l| l.split(',').nth(1))
            .map(|v| v.trim_matches('"').parse::<f64>())
            .transpose()?
            .ok_or_else(|| format!("no {test} line in redis-benchmark's output: {text}").into())
    };
    Ok((field("SET")?, field("GET")?))
}

fn print(rows: &[Row]) {
    for r in rows {
        println!("| {} | {:.0} |", r.label, median(r.samples.clone()));
    }
}

fn get(rows: &[Row], label: &str) -> f64 {
    rows.iter()
        .find(|r| r.label == label)
        .map(|r| median(r.samples.clone()))
        .unwrap_or(f64::NAN)
}

fn main() -> Res<()> {
    let args = Args::parse();
    let base = AtomicU64::new(1 << 40);
    if let Some(bytes) = args.cache_bytes {
        CACHE_BYTES.set(bytes).expect("set once");
    }
    if let Some(n) = args.profile {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        return rt.block_on(async {
            let idem = match args.profile_cache {
                None => Idem::memory(),
                Some(cache) => round_trip_idem(cache == Switch::On),
            };
            for k in 0..n {
                idem_call(&idem, k).await?;
            }
            for _ in 0..args.profile_replays {
                for k in 0..n {
                    idem_call(&idem, k).await?;
                }
            }
            Ok(())
        });
    }

    if args.cache_only {
        return replay_cache(&args, &base);
    }
    if !args.redis_only {
        in_process(&args, &base)?;
        replay_cache(&args, &base)?;
    }
    if args.no_redis {
        return Ok(());
    }
    redis_half(&args, &base)
}

/// One system measured: its calls, and for a store in memory, how to make an empty one.
struct Measured {
    name: &'static str,
    call: Call,
    /// Each fresh-call sample of a memory store starts on an empty store of its own: one
    /// store kept across samples grows to millions of records, and its table's doublings
    /// land in some samples and not others.
    empty: Option<fn() -> Call>,
}

impl Measured {
    /// A system on a store in memory, measured on an empty one made by `empty`.
    fn fresh(name: &'static str, empty: fn() -> Call) -> Self {
        Measured {
            name,
            call: empty(),
            empty: Some(empty),
        }
    }

    /// A system whose store is kept across samples (a database keeps its table).
    fn kept(name: &'static str, call: Call) -> Self {
        Measured {
            name,
            call,
            empty: None,
        }
    }
}

fn idem_memory() -> Call {
    idem_calls(Idem::memory())
}

fn peer_in_memory() -> Call {
    peer_calls(Arc::new(peer_memory()))
}

fn idem_memory_large() -> Call {
    idem_calls_of(Idem::memory(), Size::Large, true)
}

/// idem with no fingerprint: the call's cost apart from hashing the request.
fn idem_memory_unhashed() -> Call {
    idem_calls_of(Idem::memory(), Size::Small, false)
}

fn idem_memory_large_unhashed() -> Call {
    idem_calls_of(Idem::memory(), Size::Large, false)
}

fn peer_in_memory_large() -> Call {
    peer_calls_sized(Arc::new(peer_memory()), Size::Large)
}

/// The harness alone: a boxed call that returns at once, run by the same tasks. Its time
/// per call is in every other system's, so a library's own time per call is the
/// difference.
fn harness() -> Call {
    Arc::new(|k| {
        Box::pin(async move {
            std::hint::black_box(k);
            Res::Ok(())
        })
    })
}

/// Both libraries on their memory stores (inside a runtime: the peer's store spawns a
/// task): with the small request, then with the 4 KiB one, idem with each request and no
/// fingerprint, and the harness alone.
fn memory_systems() -> [Measured; 7] {
    [
        ("idem", idem_memory as fn() -> Call),
        ("idempotent", peer_in_memory),
        ("idem 4 KiB", idem_memory_large),
        ("idempotent 4 KiB", peer_in_memory_large),
        ("idem unhashed", idem_memory_unhashed),
        ("idem 4 KiB unhashed", idem_memory_large_unhashed),
        ("harness", harness),
    ]
    .map(|(name, empty)| Measured::fresh(name, empty))
}

/// `systems` compared at 1 caller on a current-thread runtime, then at 64 tasks on a
/// runtime of two workers, which is handed back for more work.
fn at_1_and_64<const N: usize>(
    systems: fn() -> [Measured; N],
    args: &Args,
    base: &AtomicU64,
) -> Res<(AtOneAnd64, tokio::runtime::Runtime)> {
    let single = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let rows1 = single.block_on(async { compare(&systems(), &[1], args, base).await })?;
    drop(single);
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let rows64 = multi.block_on(async { compare(&systems(), &[64], args, base).await })?;
    Ok((AtOneAnd64 { rows1, rows64 }, multi))
}

/// The rows of the same systems measured at 1 caller and at 64 tasks.
struct AtOneAnd64 {
    rows1: Vec<Row>,
    rows64: Vec<Row>,
}

impl AtOneAnd64 {
    /// Both as one table, then a blank line.
    fn print(&self) {
        println!("| operation | ops/s |\n|---|---|");
        print(&self.rows1);
        print(&self.rows64);
        println!();
    }

    /// The median of `label`, measured with `callers` (1 or 64).
    fn get(&self, callers: usize, label: &str) -> f64 {
        get(
            if callers == 1 {
                &self.rows1
            } else {
                &self.rows64
            },
            label,
        )
    }
}

/// The rows each in-process summary reports: request size, then phase and callers.
fn report_rows() -> impl Iterator<Item = (&'static str, (&'static str, usize))> {
    ["", " 4 KiB"].into_iter().flat_map(|size| {
        [("fresh", 1), ("replay", 1), ("fresh", 64), ("replay", 64)].map(|row| (size, row))
    })
}

fn in_process(args: &Args, base: &AtomicU64) -> Res<()> {
    // Memory first, in a process that has done nothing else yet.
    let mem_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (idem_b, peer_b) = mem_rt.block_on(async {
        let b = base.fetch_add(1 << 32, Ordering::Relaxed);
        let idem = idem_memory();
        let idem_b = bytes_per_record(&idem, args.records, b).await?;
        let peer = peer_in_memory();
        let peer_b = bytes_per_record(&peer, args.records, b).await?;
        Res::Ok((idem_b, peer_b))
    })?;
    println!(
        "- heap bytes per stored record ({} records): idem {idem_b:.0}, idempotent {peer_b:.0}",
        args.records
    );

    drop(mem_rt);
    trim_heap();

    println!("## In process (memory stores)\n");
    let (rows, multi) = at_1_and_64(memory_systems, args, base)?;
    let peaks = multi.block_on(async {
        let mut peaks = Vec::new();
        for Measured { name, call, .. } in memory_systems().into_iter().take(2) {
            record_replay_keys(&call, 0).await?;
            peaks.push((name, replay_peak(&call, 64, args.secs).await?));
        }
        Res::Ok(peaks)
    })?;
    rows.print();
    for (size, (what, c)) in report_rows() {
        let a = rows.get(c, &format!("idem{size} {what} ×{c}"));
        let b = rows.get(c, &format!("idempotent{size} {what} ×{c}"));
        println!("- {what}{size} ×{c}: idem / idempotent = {:.2}", a / b);
    }
    for (size, (what, c)) in report_rows() {
        let a = rows.get(c, &format!("idem{size} unhashed {what} ×{c}"));
        let b = rows.get(c, &format!("idempotent{size} {what} ×{c}"));
        println!(
            "- {what}{size} ×{c}, no fingerprint (floor): idem / idempotent = {:.2}",
            a / b
        );
    }
    // Each library's time per call less the harness's, as a ratio: what the libraries
    // themselves spend, with the tasks, boxing and clock of the harness taken out.
    for (size, (what, c)) in report_rows() {
        let h = 1.0 / rows.get(c, &format!("harness {what} ×{c}"));
        let a = 1.0 / rows.get(c, &format!("idem{size} {what} ×{c}")) - h;
        let b = 1.0 / rows.get(c, &format!("idempotent{size} {what} ×{c}")) - h;
        println!(
            "- {what}{size} ×{c}, net of the harness ({:.0} ns a call): idem {:.0} ns, \
             idempotent {:.0} ns, idem / idempotent = {:.2}",
            h * 1e9,
            a * 1e9,
            b * 1e9,
            b / a
        );
    }
    let [(_, idem_peak), (_, peer_peak)] = peaks[..] else {
        return Err("a peak per system".into());
    };
    println!(
        "- peak heap in flight, 64 tasks replaying: idem {:.1} KiB, idempotent {:.1} KiB \
         (idem / idempotent = {:.2})",
        idem_peak / 1024.0,
        peer_peak / 1024.0,
        idem_peak / peer_peak
    );

    Ok(())
}

/// The memory store behind a wrapper that forwards each call as a boxed future: to idem it
/// is a store with a round trip (of no latency), so the replay cache in front of it is
/// read and filled as in front of a database, and its cost is the largest share of a
/// call it can be.
struct RoundTrip(MemoryStore);

#[async_trait::async_trait]
impl Delegate for RoundTrip {
    fn inner(&self) -> &dyn Store {
        &self.0
    }
}

/// On or off.
#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Switch {
    On,
    Off,
}

fn round_trip(cache: bool, size: Size) -> Call {
    idem_calls_of(round_trip_idem(cache), size, true)
}

fn round_trip_idem(cache: bool) -> Idem {
    let builder = Idem::builder();
    let builder = match (cache, CACHE_BYTES.get()) {
        (true, Some(&bytes)) => builder.replay_cache_bytes(bytes),
        (true, None) => builder,
        (false, _) => builder.replay_cache_bytes(0),
    };
    let store: Arc<dyn Delegate> = Arc::new(RoundTrip(MemoryStore::default()));
    builder.store(store)
}

/// The replay cache (its default budget) on against off, in front of [`RoundTrip`], with
/// each request at 1 caller and 64 tasks.
fn replay_cache(args: &Args, base: &AtomicU64) -> Res<()> {
    fn systems() -> [Measured; 4] {
        [
            (
                "cache off",
                (|| round_trip(false, Size::Small)) as fn() -> Call,
            ),
            ("cache on", || round_trip(true, Size::Small)),
            ("cache off 4 KiB", || round_trip(false, Size::Large)),
            ("cache on 4 KiB", || round_trip(true, Size::Large)),
        ]
        .map(|(name, empty)| Measured::fresh(name, empty))
    }
    println!("\n## The replay cache, in front of the memory store behind a round trip\n");
    let (rows, _) = at_1_and_64(systems, args, base)?;
    rows.print();
    for (size, (what, c)) in report_rows() {
        let on = rows.get(c, &format!("cache on{size} {what} ×{c}"));
        let off = rows.get(c, &format!("cache off{size} {what} ×{c}"));
        println!("- {what}{size} ×{c}: cache on / off = {:.2}", on / off);
    }
    Ok(())
}

fn redis_half(args: &Args, base: &AtomicU64) -> Res<()> {
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let server = start_redis()?;
    let url = format!("redis://127.0.0.1:{}", server.port);
    println!("\n## Redis (a redis-server of the bench's own, persistence off)\n");
    if std::env::var_os("IDEM_BENCH_COMMANDS").is_some() {
        multi.block_on(commands_per_op(&url))?;
    }
    let rows = multi.block_on(async {
        let cached = Idem::builder()
            .key_prefix("idem-bench-cached")
            .redis(&url)
            .await?;
        let uncached = Idem::builder()
            .key_prefix("idem-bench")
            .replay_cache_bytes(0)
            .redis(&url)
            .await?;
        let peer =
            idempotent::store::valkey::ValkeyStore::new(redis::Client::open(url.as_str())?).await?;
        let systems = [
            Measured::kept("idem", idem_calls(uncached)),
            Measured::kept("idem (replay cache)", idem_calls(cached)),
            Measured::kept("idempotent", peer_calls(Arc::new(peer))),
            Measured::kept(FLOOR, floor_calls(&url, "floor", true).await?),
            Measured::kept(READ_FLOOR, floor_calls(&url, "floor", false).await?),
            Measured::kept(COMMANDS, command_floor_calls(&url, "commands").await?),
            Measured::kept(
                READ_COMMANDS,
                read_command_floor_calls(&url, "read-commands", false).await?,
            ),
            Measured::kept(
                READ_HMGET,
                read_command_floor_calls(&url, "read-timed", true).await?,
            ),
        ];
        let rows = compare(&systems, &[1, 16], args, base).await?;
        // Which side holds the 16-caller rates back: each process's CPU time over one
        // more measurement of each, as a share of its core.
        let mut shares = Vec::new();
        let (ticks, server_pid) = (clock_ticks(), server.child.id().to_string());
        let cpu = || Res::Ok((cpu_secs("self", ticks)?, cpu_secs(&server_pid, ticks)?));
        for Measured { name, call, .. } in &systems {
            if args.only.as_deref().is_some_and(|o| o != *name) {
                continue;
            }
            for what in ["fresh", "replay"] {
                if !measures(name, what) {
                    continue;
                }
                let b = base.fetch_add(1 << 32, Ordering::Relaxed);
                let cycle = (what == "replay").then_some(REPLAY_KEYS);
                if cycle.is_some() {
                    record_replay_keys(call, b).await?;
                }
                let before = cpu()?;
                let start = Instant::now();
                rate(call, 16, args.secs, b, cycle).await?;
                let wall = start.elapsed().as_secs_f64();
                let after = cpu()?;
                shares.push((
                    *name,
                    what,
                    (after.0 - before.0) / wall,
                    (after.1 - before.1) / wall,
                ));
            }
        }
        Res::Ok((rows, shares))
    })?;
    let (rows, shares) = rows;
    let mut floors = Vec::new();
    for c in [1, 16] {
        let mut sets = Vec::new();
        let mut gets = Vec::new();
        for _ in 0..args.rounds {
            let (s, g) = redis_floor(server.port, c, args.secs)?;
            sets.push(s);
            gets.push(g);
        }
        floors.push((c, median(sets), median(gets)));
    }
    println!("| operation | ops/s |\n|---|---|");
    print(&rows);
    for (c, s, g) in &floors {
        println!("| redis-benchmark SET ×{c} | {s:.0} |\n| redis-benchmark GET ×{c} | {g:.0} |");
    }
    println!();
    for c in [1, 16] {
        let on = |what: &str| get(&rows, &format!("idem (replay cache) {what} ×{c}"));
        let off = |what: &str| get(&rows, &format!("idem {what} ×{c}"));
        println!(
            "- ×{c}: replay cache on / off, fresh = {:.2}, replay = {:.2}",
            on("fresh") / off("fresh"),
            on("replay") / off("replay")
        );
    }
    for (c, set, getf) in &floors {
        let f = get(&rows, &format!("idem fresh ×{c}"));
        let r = get(&rows, &format!("idem replay ×{c}"));
        let pf = get(&rows, &format!("idempotent fresh ×{c}"));
        let pr = get(&rows, &format!("idempotent replay ×{c}"));
        let ff = get(&rows, &format!("{FLOOR} fresh ×{c}"));
        let fc = get(&rows, &format!("{COMMANDS} fresh ×{c}"));
        let rf = get(&rows, &format!("{READ_FLOOR} replay ×{c}"));
        let rc = get(&rows, &format!("{READ_COMMANDS} replay ×{c}"));
        let rh = get(&rows, &format!("{READ_HMGET} replay ×{c}"));
        println!(
            "- ×{c}: fresh idem / idempotent = {:.2}, idem / SET floor = {:.2}, \
             idem / {FLOOR} = {:.2}, idempotent / {FLOOR} = {:.2}, \
             idem / {COMMANDS} = {:.2}, {COMMANDS} / idempotent = {:.2}; \
             replay idem / idempotent = {:.2}, idem / GET floor = {:.2}, \
             idem / {READ_FLOOR} = {:.2}, idempotent / {READ_FLOOR} = {:.2}, \
             idem / {READ_COMMANDS} = {:.2}, idempotent / {READ_COMMANDS} = {:.2}, \
             {READ_HMGET} / idempotent = {:.2}",
            f / pf,
            f / set,
            f / ff,
            pf / ff,
            f / fc,
            fc / pf,
            r / pr,
            r / getf,
            r / rf,
            pr / rf,
            r / rc,
            pr / rc,
            rh / pr
        );
    }
    for (name, what, client, server) in shares {
        println!(
            "- {name} {what} ×16, share of a core busy: client {:.0}%, server {:.0}%",
            client * 100.0,
            server * 100.0
        );
    }
    drop(server);
    Ok(())
}

/// CPU seconds (user and system) the process `pid` (or `self`) has used, from
/// `/proc/<pid>/stat`, which counts in `ticks` a second.
fn cpu_secs(pid: &str, ticks: f64) -> Res<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses and may hold spaces;
    // utime and stime are the 14th and 15th of the line.
    let rest = stat.rsplit_once(')').ok_or("a /proc stat line")?.1;
    let field = |n: usize| -> Res<f64> {
        Ok(rest
            .split_whitespace()
            .nth(n)
            .ok_or("a /proc stat field")?
            .parse::<f64>()?)
    };
    Ok((field(11)? + field(12)?) / ticks)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`), in which `/proc` counts.
fn clock_ticks() -> f64 {
    number_from("getconf", "CLK_TCK").unwrap_or(100.0)
}
