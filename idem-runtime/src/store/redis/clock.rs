//! The server's clock as this process bounds it on a standalone server, from samples of
//! it: a `TIME` read, or a fresh claim's epoch (the server's `TIME` in µs when the
//! claim ran), each carried forward by this process's monotonic clock for a second.
//!
//! Two bounds, both sound whatever the round trip, both clocks running at the same
//! rate. The most the server's clock can read ([`ServerClock::latest_ms`]): the sample
//! plus the time since its request was sent, as the sample ran after the send; most
//! replays then send `HMGET` alone. The least it can read ([`ServerClock::least_ms`]):
//! the sample plus the time since its reply arrived, as the sample ran before the
//! arrival; a record's script is then handed its retention deadline, never past the
//! server's clock at the write plus `retain`, and reads no `TIME`.
//!
//! A sample is trusted for a second, so a slewing clock (at most 500 ppm under NTP)
//! moves either bound by half a millisecond at most. A server clock stepped forward
//! since the sample is not seen until the next: within that second a record may replay
//! that the server already counts as past its retention by up to the step, a replay
//! rather than a second run of its body, and a record written then keeps its outcome
//! up to the step short of `retain`. A bound too high only sends a replay on to the
//! claim, which decides by the server's own clock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// How long a sample of the server's clock is trusted.
const FRESH_FOR: Duration = Duration::from_secs(1);

/// [`FRESH_FOR`] in µs, as this process's clock counts.
const FRESH_FOR_US: i64 = FRESH_FOR.as_micros() as i64;

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
    /// The sample of the latest server time noted, for the least bound.
    least: Mutex<Option<Arrived>>,
}

/// A sample of the server's clock and when its reply arrived.
#[derive(Debug, Clone, Copy)]
struct Arrived {
    /// The server's clock (µs).
    server_us: i64,
    /// This process's clock (µs) when the reply arrived.
    got_us: i64,
}

impl ServerClock {
    pub(super) fn new() -> ServerClock {
        ServerClock {
            base: Instant::now(),
            offset_us: AtomicI64::new(0),
            sent_us: AtomicI64::new(NONE),
            least: Mutex::new(None),
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
        sent != NONE && now_us - sent < FRESH_FOR_US
    }

    /// Takes a sample of the server's clock (µs) from a request sent at `sent_us` whose
    /// reply arrived at `got_us`, both by [`local_us`](Self::local_us).
    pub(super) fn note(&self, sent_us: i64, got_us: i64, server_us: i64) {
        self.offset_us
            .store(server_us.saturating_sub(sent_us), Ordering::Relaxed);
        self.sent_us.store(sent_us, Ordering::Release);
        let mut least = self.least.lock().unwrap_or_else(|p| p.into_inner());
        // The latest server time is kept, as it bounds records of every epoch up to it,
        // until it goes stale (a server clock stepped back stays usable).
        let stale = |l: &Arrived| got_us - l.got_us >= FRESH_FOR_US;
        if least.is_none_or(|l| l.server_us <= server_us || stale(&l)) {
            *least = Some(Arrived { server_us, got_us });
        }
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

    /// The least the server's clock (in whole ms) can read now, from a fresh sample
    /// that ran no earlier than `since_us` on the server's clock; `None` without one.
    /// A record passes its epoch: a claim's epoch is at least the server's clock when
    /// the claim ran, so the bound is never below the server's clock at the claim's
    /// send, where the replay cache starts its entry's life.
    pub(super) fn least_ms(&self, since_us: i64) -> Option<i64> {
        let sample = (*self.least.lock().unwrap_or_else(|p| p.into_inner()))?;
        let now_us = self.local_us();
        let fresh = now_us - sample.got_us < FRESH_FOR_US;
        (fresh && sample.server_us >= since_us).then(|| {
            sample
                .server_us
                .saturating_add(now_us - sample.got_us)
                .div_euclid(1000)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounds move with this process's clock from the sample's send (the most) and
    /// its arrival (the least), and only a fresh sample gives them.
    #[test]
    fn the_bounds_are_the_sample_carried_forward() {
        let clock = ServerClock::new();
        assert_eq!(clock.latest_ms(), None);
        assert_eq!(clock.least_ms(0), None);
        // A reply that took 5 ms: the bounds are that far apart.
        let got = clock.local_us();
        let sent = got - 5_000;
        let server = 1_800_000_000_250_000;
        clock.note(sent, got, server);
        let least = clock
            .least_ms(server)
            .expect("fresh, and no earlier than the epoch");
        let most = clock.latest_ms().expect("fresh");
        assert!(most >= 1_800_000_000_250, "{most}");
        assert!(
            least >= 1_800_000_000_250 && least + 5 <= most,
            "{least} {most}"
        );
        std::thread::sleep(Duration::from_millis(30));
        let later = clock.latest_ms().expect("fresh");
        assert!(later >= most + 30, "{later} after {most}");
        let later = clock.least_ms(server).expect("fresh");
        assert!(later >= least + 30, "{later} after {least}");
        // A claim after the sample (a later epoch) is not bounded by it.
        assert_eq!(clock.least_ms(server + 1), None);
        // An earlier sample does not replace a later one.
        clock.note(sent, got, server - 1_000_000);
        assert!(clock.least_ms(server).is_some());
        // A sample sent over a second ago bounds nothing.
        let old = sent - 2 * FRESH_FOR_US;
        clock.note(old, old + 5_000, 1_800_000_000_000_000);
        assert_eq!(clock.latest_ms(), None);
    }

    /// A sample that went stale gives way to any later one, whatever its server time
    /// (the server's clock stepped back), and a stale one bounds nothing.
    #[test]
    fn a_stale_least_bound_gives_way() {
        let clock = ServerClock::new();
        let now = clock.local_us();
        let old = now - 2 * FRESH_FOR_US;
        clock.note(old, old + 1_000, 1_900_000_000_000_000);
        assert_eq!(clock.least_ms(0), None);
        clock.note(now, now + 1_000, 1_800_000_000_000_000);
        assert!(clock.least_ms(1_800_000_000_000_000).is_some());
    }
}
