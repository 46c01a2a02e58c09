//! The knobs both benches read from the environment.

use std::time::Duration;

use sqlx::Database;
use sqlx::pool::PoolOptions;

use super::POOL;

/// The environment variable `name`, unless it is unset or empty.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Whether the switch `name` is on: set to anything but `0`.
pub fn set(name: &str) -> bool {
    var(name).is_some_and(|v| v != "0")
}

/// The environment variable `name` parsed, or `default` where it is unset or does not
/// parse.
pub fn parsed<T: std::str::FromStr>(name: &str, default: T) -> T {
    var(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The server, how long and how often each subject is measured, and the pools' ping.
pub struct Knobs {
    pub url: String,
    /// One measurement (`IDEM_BENCH_SECS`, default 2).
    pub measure: Duration,
    /// Rounds of measurements, each subject in turn (`IDEM_BENCH_ROUNDS`, default 3).
    pub rounds: usize,
    /// sqlx's ping on acquire, unless `IDEM_BENCH_NO_PING` is set.
    pub ping: bool,
}

impl Knobs {
    /// The knobs, with the server's URL from `url_var` or else `default_url`.
    pub fn from_env(url_var: &str, default_url: &str) -> Knobs {
        Knobs {
            url: var(url_var).unwrap_or_else(|| default_url.into()),
            measure: Duration::from_secs_f64(parsed("IDEM_BENCH_SECS", 2.0)),
            rounds: parsed("IDEM_BENCH_ROUNDS", 3).max(1),
            ping: !set("IDEM_BENCH_NO_PING"),
        }
    }

    /// The same pool for idem and for the baseline: sqlx's defaults, big enough.
    pub fn pool<DB: Database>(&self) -> PoolOptions<DB> {
        PoolOptions::new()
            .max_connections(POOL)
            .min_connections(POOL)
            .test_before_acquire(self.ping)
    }
}
