//! The server's clock as a standalone server's replay read bounds it: a `TIME` read
//! within the last second, carried forward by this process's monotonic clock, so most
//! replays send `HMGET` alone.
//!
//! The bound is sound whatever the round trip: `TIME` ran after its request was sent,
//! so at any later moment the server's clock reads at most `TIME` plus the time since
//! that send, both clocks running at the same rate. A sample is trusted for a second, so
//! a slewing clock (at most 500 ppm under NTP) moves the bound by half a millisecond at
//! most. A server clock stepped forward since the sample is not seen until the next:
//! within that second a record may replay that the server already counts as past its
//! retention by up to the step, a replay rather than a second run of its body. A bound
//! too high only sends a replay on to the claim, which decides by the server's own clock.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// How long a sample of the server's clock is trusted.
const FRESH_FOR: Duration = Duration::from_secs(1);

/// No sample yet.
const NONE: i64 = i64::MIN;

#[derive(Debug)]
pub(super) struct ServerClock {
    /// What this process's clock counts from.
    base: Instant,
    /// The server's clock (µs) less this process's at the sample's send: the server's
    /// clock is at most this plus this process's clock, ever after.
    offset_us: AtomicI64,
    /// When the sample's request was sent, by this process's clock (µs); [`NONE`]
    /// before the first.
    sent_us: AtomicI64,
}

impl ServerClock {
    pub(super) fn new() -> ServerClock {
        ServerClock {
            base: Instant::now(),
            offset_us: AtomicI64::new(0),
            sent_us: AtomicI64::new(NONE),
        }
    }

    /// This process's clock, in µs since the store opened.
    pub(super) fn local_us(&self) -> i64 {
        i64::try_from(self.base.elapsed().as_micros()).unwrap_or(i64::MAX)
    }

    /// Whether a sample is fresh enough to bound the server's clock.
    pub(super) fn fresh(&self) -> bool {
        self.fresh_at(self.local_us())
    }

    /// Whether a sample is fresh at this process's clock reading `now_us`.
    fn fresh_at(&self, now_us: i64) -> bool {
        let sent = self.sent_us.load(Ordering::Acquire);
        sent != NONE && now_us - sent < FRESH_FOR.as_micros() as i64
    }

    /// Takes `TIME`'s reply (`secs`, `micros`) to a request sent at `sent_us`.
    pub(super) fn note(&self, sent_us: i64, secs: i64, micros: i64) {
        let server_us = secs.saturating_mul(1_000_000).saturating_add(micros);
        self.offset_us
            .store(server_us.saturating_sub(sent_us), Ordering::Relaxed);
        self.sent_us.store(sent_us, Ordering::Release);
    }

    /// The most the server's clock (in whole ms, as the scripts count) can read now, if
    /// a fresh sample bounds it. Any sample gives a sound bound; freshness keeps drift
    /// and steps out of it.
    pub(super) fn latest_ms(&self) -> Option<i64> {
        let now_us = self.local_us();
        if !self.fresh_at(now_us) {
            return None;
        }
        let offset = self.offset_us.load(Ordering::Relaxed);
        Some(offset.saturating_add(now_us).div_euclid(1000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound moves with this process's clock from the sample's send, and only a
    /// fresh sample gives one.
    #[test]
    fn the_bound_is_the_sample_carried_forward() {
        let clock = ServerClock::new();
        assert_eq!(clock.latest_ms(), None);
        let sent = clock.local_us();
        clock.note(sent, 1_800_000_000, 250_000);
        let first = clock.latest_ms().expect("fresh");
        assert!(first >= 1_800_000_000_250, "{first}");
        std::thread::sleep(Duration::from_millis(30));
        let later = clock.latest_ms().expect("fresh");
        assert!(later >= first + 30, "{later} after {first}");
        // A sample sent over a second ago bounds nothing.
        clock.note(sent - 2 * FRESH_FOR.as_micros() as i64, 1_800_000_000, 0);
        assert_eq!(clock.latest_ms(), None);
    }
}
