//! What the database benches `pg` and `mysql` share: the knobs they read from the
//! environment, the constants their baselines bind, and the driver that runs and times
//! their subjects.
//!
//! Each bench is a crate of its own and includes this module with `mod support;`. Every
//! item here is used by both, so neither needs `#[allow(dead_code)]`. The files that only
//! one bench needs sit beside it and are included by that bench alone: `pg_*.rs` and
//! `pgbench.rs` by `pg.rs` (they need sqlx's PostgreSQL driver, which the `mysql` bench
//! does not build), and `fill.rs` by `purge.rs`, `growth.rs` and `soak.rs`.

pub mod config;
pub mod driver;

use std::error::Error;

pub type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Connections per pool: the highest concurrency measured.
pub const POOL: u32 = 16;
/// The operation name of every call.
pub const NAME: &str = "bench";
/// idem's defaults, as the baselines bind them.
pub const LEASE_MS: i64 = 60_000;
pub const RETAIN_MS: i64 = 86_400_000;
/// Any fixed fingerprint: the baselines bind 32 bytes, as idem does.
pub const FINGERPRINT: [u8; 32] = [7; 32];

pub fn check(ok: bool, what: &'static str) -> Res<()> {
    if ok { Ok(()) } else { Err(what.into()) }
}

/// Runs `bench` on a multi-threaded tokio runtime.
pub fn block_on(bench: impl Future<Output = Res<()>>) -> Res<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(bench)
}
