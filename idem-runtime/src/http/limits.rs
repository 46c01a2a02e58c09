//! What bounds `IdempotencyLayer`'s work per request: reading a request body (its
//! declared length, its read time, and the bytes buffered across all requests at once)
//! and the rate of new claims per scope.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use http::HeaderMap;
use http::header::CONTENT_LENGTH;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::problem::Problem;

/// The `Retry-After` of a 503 for a full buffer budget: buffered bodies are read in
/// well under a second when their clients send them at all.
pub(super) const BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The bytes of request bodies a layer holds at once, shared by every request through
/// it (and its clones).
#[derive(Clone, Debug)]
pub(super) struct Budget {
    bytes: usize,
    permits: Arc<Semaphore>,
}

impl Budget {
    pub(super) fn new(bytes: usize) -> Budget {
        let bytes = bytes.min(Semaphore::MAX_PERMITS);
        Budget {
            bytes,
            permits: Arc::new(Semaphore::new(bytes)),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// `n` more bytes, at once or not at all (a 503 to answer).
    fn reserve(&self, n: usize) -> Result<OwnedSemaphorePermit, Busy> {
        let n = u32::try_from(n).map_err(|_| Busy)?;
        self.permits
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| Busy)
    }
}

/// The budget cannot hold a body now.
struct Busy;

impl From<Busy> for Problem {
    fn from(_: Busy) -> Problem {
        Problem::busy(BUSY_RETRY_AFTER)
    }
}

/// A request body, buffered, and its share of the budget (held until the request is
/// done with the bytes).
#[derive(Debug)]
pub(super) struct Buffered {
    pub(super) bytes: Bytes,
    pub(super) permit: Option<OwnedSemaphorePermit>,
}

/// Reads `body` whole, at most `max` bytes within `timeout`, reserving its bytes from
/// `budget` as they come (the declared `Content-Length` up front).
///
/// Refuses, before reading a byte, a declared length over `max` (413); a body still
/// arriving after `timeout` is a 408; bytes the budget cannot hold are a 503 with
/// `Retry-After`.
pub(super) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    max: usize,
    timeout: Duration,
    budget: &Budget,
) -> Result<Buffered, Problem> {
    let declared = declared_length(headers, &body);
    if declared.is_some_and(|n| n > max as u64) {
        return Err(Problem::body_too_large(max));
    }
    let mut reserved = declared.unwrap_or(0) as usize;
    let mut permit = match reserved {
        0 => None,
        n => Some(budget.reserve(n)?),
    };
    let read = async {
        let mut body = body;
        let mut buf: Vec<u8> = Vec::with_capacity(reserved);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| Problem::body_unreadable())?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let total = buf.len().saturating_add(data.len());
            if total > max {
                return Err(Problem::body_too_large(max));
            }
            if total > reserved {
                let more = budget.reserve(total - reserved)?;
                match &mut permit {
                    Some(permit) => permit.merge(more),
                    None => permit = Some(more),
                }
                reserved = total;
            }
            buf.extend_from_slice(&data);
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok(bytes)) => Ok(Buffered { bytes, permit }),
        Ok(Err(problem)) => Err(problem),
        Err(_) => Err(Problem::body_timeout(timeout)),
    }
}

/// The body's length as declared: `Content-Length` (the largest, if repeated), or the
/// body's own lower bound, whichever is larger.
fn declared_length(headers: &HeaderMap, body: &Body) -> Option<u64> {
    let header = headers
        .get_all(CONTENT_LENGTH)
        .iter()
        .filter_map(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .max();
    let hint = body.size_hint().lower();
    match header {
        Some(n) => Some(n.max(hint)),
        None if hint > 0 => Some(hint),
        None => None,
    }
}

/// A token bucket per scope: `burst` new claims at once, then one more every `every`.
#[derive(Debug)]
pub(super) struct ClaimLimiter {
    burst: u32,
    every: Duration,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: u32,
    /// When the bucket last held `tokens` (refills count from here).
    since: Instant,
}

/// Scopes with a full bucket are forgotten once the map holds this many: a full bucket
/// is what a scope seen for the first time gets, so forgetting it changes nothing.
const PRUNE_AT: usize = 4096;

impl ClaimLimiter {
    pub(super) fn new(burst: u32, every: Duration) -> ClaimLimiter {
        ClaimLimiter {
            burst,
            every,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one claim for `scope`, or says how long until one is free.
    pub(super) fn take(&self, scope: &str) -> Result<(), Duration> {
        let now = Instant::now();
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= PRUNE_AT && !buckets.contains_key(scope) {
            buckets.retain(|_, b| self.refill(*b, now).tokens < self.burst);
        }
        let bucket = buckets.entry(scope.to_owned()).or_insert(Bucket {
            tokens: self.burst,
            since: now,
        });
        *bucket = self.refill(*bucket, now);
        if bucket.tokens > 0 {
            bucket.tokens -= 1;
            return Ok(());
        }
        Err(self
            .every
            .saturating_sub(now.saturating_duration_since(bucket.since)))
    }

    fn refill(&self, b: Bucket, now: Instant) -> Bucket {
        if b.tokens >= self.burst || self.every.is_zero() {
            return Bucket {
                tokens: self.burst,
                since: now,
            };
        }
        let elapsed = now.saturating_duration_since(b.since);
        let earned = elapsed.as_nanos() / self.every.as_nanos();
        if earned == 0 {
            return b;
        }
        let tokens = u128::from(b.tokens).saturating_add(earned);
        if tokens >= u128::from(self.burst) {
            return Bucket {
                tokens: self.burst,
                since: now,
            };
        }
        // Keep the part of an interval already waited.
        Bucket {
            tokens: tokens as u32,
            since: b.since + self.every * earned as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_beyond_the_burst_wait_for_a_refill() {
        let limiter = ClaimLimiter::new(2, Duration::from_secs(3600));
        assert!(limiter.take("a").is_ok());
        assert!(limiter.take("a").is_ok());
        let wait = limiter.take("a").unwrap_err();
        assert!(wait > Duration::from_secs(3500) && wait <= Duration::from_secs(3600));
        assert!(limiter.take("b").is_ok(), "scopes are limited apart");
    }

    #[test]
    fn tokens_come_back_one_interval_at_a_time() {
        let limiter = ClaimLimiter::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let empty = Bucket {
            tokens: 0,
            since: t0,
        };
        let later = limiter.refill(empty, t0 + Duration::from_secs(25));
        assert_eq!(later.tokens, 2);
        assert_eq!(later.since, t0 + Duration::from_secs(20));
        assert_eq!(
            limiter.refill(empty, t0 + Duration::from_secs(99)).tokens,
            3
        );
        assert_eq!(limiter.refill(empty, t0 + Duration::from_secs(9)).tokens, 0);
    }

    #[test]
    fn the_map_forgets_full_buckets() {
        let limiter = ClaimLimiter::new(1, Duration::ZERO);
        for i in 0..PRUNE_AT * 2 {
            limiter.take(&i.to_string()).unwrap();
        }
        assert!(limiter.buckets.lock().unwrap().len() <= PRUNE_AT);
    }

    #[tokio::test]
    async fn a_budget_holds_what_it_reserved_until_dropped() {
        let budget = Budget::new(100);
        let headers = HeaderMap::new();
        let a = read_body(
            &headers,
            Body::from(vec![0; 60]),
            100,
            Duration::from_secs(5),
            &budget,
        )
        .await
        .unwrap();
        let b = read_body(
            &headers,
            Body::from(vec![0; 60]),
            100,
            Duration::from_secs(5),
            &budget,
        )
        .await
        .unwrap_err();
        assert_eq!(b.status, 503);
        assert_eq!(b.retry_after, Some(1));
        drop(a);
        read_body(
            &headers,
            Body::from(vec![0; 60]),
            100,
            Duration::from_secs(5),
            &budget,
        )
        .await
        .unwrap();
    }
}
