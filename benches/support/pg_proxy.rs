//! Counting what a subject costs per operation: a TCP proxy that reads the client's
//! side of the PostgreSQL wire protocol, and the server's statistics.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sqlx::Executor;
use sqlx::postgres::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::pg_config::quoted;
use crate::pg_subject::{Phase, Subject};
use crate::support::Res;
use crate::support::driver::{Stop, drive};

/// Operations in each counted run, and before it to warm the statement caches.
pub const COUNTED: u64 = 400;

/// What the client sent through the counting proxy.
#[derive(Default)]
pub struct Wire {
    queries: AtomicU64,
    executes: AtomicU64,
    syncs: AtomicU64,
    parses: AtomicU64,
    /// Statements executed, by text.
    executed: Mutex<BTreeMap<String, u64>>,
}

#[derive(Clone, Copy, Debug)]
pub struct Tally {
    queries: u64,
    executes: u64,
    syncs: u64,
    parses: u64,
}

impl Tally {
    pub fn since(self, before: Tally) -> Tally {
        Tally {
            queries: self.queries - before.queries,
            executes: self.executes - before.executes,
            syncs: self.syncs - before.syncs,
            parses: self.parses - before.parses,
        }
    }

    pub fn statements(self) -> u64 {
        self.queries + self.executes
    }

    /// Each `Sync` and each simple `Query` waits for the server. A `Parse` (a statement
    /// prepared on this connection for the first time) costs one of them, which a warm
    /// statement cache does not pay, so it is not counted.
    pub fn round_trips(self) -> u64 {
        (self.syncs + self.queries).saturating_sub(self.parses)
    }
}

impl Wire {
    pub fn tally(&self) -> Tally {
        let n = |c: &AtomicU64| c.load(Ordering::SeqCst);
        Tally {
            queries: n(&self.queries),
            executes: n(&self.executes),
            syncs: n(&self.syncs),
            parses: n(&self.parses),
        }
    }

    fn take_executed(&self) -> BTreeMap<String, u64> {
        std::mem::take(&mut *self.executed.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn execute(&self, sql: &str) {
        let mut executed = self.executed.lock().unwrap_or_else(|p| p.into_inner());
        *executed.entry(sql.to_owned()).or_default() += 1;
    }
}

/// The NUL-terminated strings at the start of a message body.
fn cstrings(body: &[u8]) -> impl Iterator<Item = String> + '_ {
    body.split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
}

/// Splits one client connection's byte stream into protocol messages.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
    started: bool,
    broken: bool,
    /// Prepared statements by name, to know what a `Bind` executes.
    prepared: HashMap<String, String>,
}

impl Frames {
    fn feed(&mut self, bytes: &[u8], wire: &Wire) {
        if self.broken {
            return;
        }
        self.buf.extend_from_slice(bytes);
        let mut at = 0;
        loop {
            let rest = &self.buf[at..];
            // Startup-phase messages have no type byte.
            let (head, len_at) = if self.started { (5, 1) } else { (8, 0) };
            if rest.len() < head {
                break;
            }
            let len = u32::from_be_bytes([
                rest[len_at],
                rest[len_at + 1],
                rest[len_at + 2],
                rest[len_at + 3],
            ]) as usize;
            if len < head - len_at {
                self.broken = true;
                return;
            }
            let total = len + len_at;
            if rest.len() < total {
                break;
            }
            if self.started {
                let (tag, body) = (rest[0], &rest[5..total]);
                let counter = match tag {
                    b'Q' => Some(&wire.queries),
                    b'E' => Some(&wire.executes),
                    b'S' => Some(&wire.syncs),
                    b'P' => Some(&wire.parses),
                    _ => None,
                };
                if let Some(counter) = counter {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                let mut strings = cstrings(body);
                match tag {
                    b'Q' => wire.execute(&strings.next().unwrap_or_default()),
                    b'P' => {
                        let name = strings.next().unwrap_or_default();
                        let sql = strings.next().unwrap_or_default();
                        self.prepared.insert(name, sql);
                    }
                    b'B' => {
                        let statement = strings.nth(1).unwrap_or_default();
                        let sql = self.prepared.get(&statement).map_or("?", String::as_str);
                        wire.execute(sql);
                    }
                    _ => {}
                }
            } else {
                let code = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]);
                // SSLRequest and GSSENCRequest are followed by another untyped message.
                self.started = !matches!(code, 80_877_103 | 80_877_104);
            }
            at += total;
        }
        self.buf.drain(..at);
    }
}

/// A TCP proxy to the server that counts what clients send; returns its port.
pub async fn spawn_proxy(host: String, port: u16, wire: Arc<Wire>) -> Res<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (host, wire) = (host.clone(), wire.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect((host.as_str(), port)).await else {
                    return;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                let down = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
                let mut frames = Frames::default();
                let mut buf = vec![0; 16 * 1024];
                loop {
                    let n = match from_client.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    // Counted before it is forwarded, so a reply implies its count.
                    frames.feed(&buf[..n], &wire);
                    if to_server.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = to_server.shutdown().await;
                let _ = down.await;
            });
        }
    });
    Ok(local)
}

/// Per operation, in one counted run.
pub struct Count {
    pub statements: f64,
    pub round_trips: f64,
    /// Server transactions (`xact_commit`), from the statistics.
    pub xacts: f64,
    /// Rows inserted, updated or deleted in the subject's table (statistics).
    pub writes: i64,
    /// Bodies run, or claims won.
    pub runs: u64,
    /// Each statement executed, by text, and how often per operation.
    pub executed: BTreeMap<String, f64>,
}

pub struct Counter {
    pub admin: PgPool,
    pub pool: PgPool,
    pub wire: Arc<Wire>,
}

impl Counter {
    /// Makes every pooled connection flush its statistics now (PostgreSQL 15+), so the
    /// server's counters are current when read; returns how many statements that took.
    async fn flush_stats(&self) -> Res<i64> {
        let mut held = Vec::new();
        for _ in 0..self.pool.size() {
            held.push(self.pool.acquire().await?);
        }
        for conn in &mut held {
            conn.execute("SELECT pg_stat_force_next_flush()").await?;
        }
        Ok(i64::try_from(held.len())?)
    }

    /// Runs `phase` for [`COUNTED`] operations after as many to warm up.
    pub async fn count(
        &self,
        subject: &Arc<Subject>,
        phase: Phase,
        concurrency: usize,
    ) -> Res<Count> {
        drive(subject, phase, concurrency, Stop::Ops(COUNTED)).await?;
        self.flush_stats().await?;
        let writes = table_writes(&self.admin, &subject.table).await?;
        let xacts = xact_commits(&self.admin).await?;
        let runs = subject.runs.load(Ordering::Relaxed);
        self.wire.take_executed();
        let before = self.wire.tally();
        drive(subject, phase, concurrency, Stop::Ops(COUNTED)).await?;
        let tally = self.wire.tally().since(before);
        let executed = self.wire.take_executed();
        let flushes = self.flush_stats().await?;
        let xacts = xact_commits(&self.admin).await? - xacts - flushes;
        let per = |n: u64| n as f64 / COUNTED as f64;
        Ok(Count {
            statements: per(tally.statements()),
            round_trips: per(tally.round_trips()),
            xacts: xacts as f64 / COUNTED as f64,
            writes: table_writes(&self.admin, &subject.table).await? - writes,
            runs: subject.runs.load(Ordering::Relaxed) - runs,
            executed: executed.into_iter().map(|(k, n)| (k, per(n))).collect(),
        })
    }
}

async fn xact_commits(admin: &PgPool) -> Res<i64> {
    Ok(sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(admin)
    .await?)
}

async fn table_writes(admin: &PgPool, table: &str) -> Res<i64> {
    let n: Option<i64> = sqlx::query_scalar(
        "SELECT n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables
         WHERE relid = to_regclass($1)",
    )
    .bind(quoted(table))
    .fetch_optional(admin)
    .await?;
    Ok(n.unwrap_or(0))
}
