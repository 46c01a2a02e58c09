//! What bounds `IdempotencyLayer`'s work per request while it reads a request body: its
//! declared length, its read time, and the bytes buffered across all requests at once.
//! (The rate of new claims is the machine's, `limit.rs`.)

use std::sync::Arc;
use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

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
