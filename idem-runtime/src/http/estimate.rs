//! The `Retry-After` of a 409: how long a route's requests take, so that a client told
//! to come back waits about as long as the request it collides with, not the whole
//! lease.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::Response;
use http::header::{HeaderValue, RETRY_AFTER};
use http::{Method, StatusCode};

use super::problem::{InFlightFor, Problem, retry_secs};

/// Routes whose durations are kept; past it, new routes get no estimate (named routes
/// are few, so only a layer named per raw path without a `MatchedPath` can reach it).
const MAX_ROUTES: usize = 4096;

/// The weight of the newest duration in a route's running estimate.
const WEIGHT: f64 = 0.25;

/// The shortest hint, and the one given before any request of the route has finished:
/// a 409 is answered at once, so a retry each second costs little.
pub(super) const MIN_HINT: Duration = Duration::from_secs(1);

/// The largest in-flight problem body rewritten with its hint; idem's own are far
/// smaller.
const MAX_PROBLEM_BYTES: usize = 16 << 10;

/// A running estimate of how long each route's requests take, shared by a layer's
/// services.
#[derive(Debug, Default)]
pub(crate) struct Durations {
    by_route: Mutex<HashMap<String, Duration>>,
}

impl Durations {
    /// Folds in one request of `route` that ran its handler and took `took`.
    pub(crate) fn observe(&self, route: &str, took: Duration) {
        let mut by_route = self.by_route.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(estimate) = by_route.get_mut(route) {
            *estimate = estimate.mul_f64(1.0 - WEIGHT) + took.mul_f64(WEIGHT);
        } else if by_route.len() < MAX_ROUTES {
            by_route.insert(route.to_owned(), took);
        }
    }

    /// The wait to suggest to a retry of `route` whose key is held for `remaining`
    /// more: the route's estimate, at least [`MIN_HINT`], at most `remaining`.
    pub(crate) fn hint(&self, route: &str, remaining: Duration) -> Duration {
        let by_route = self.by_route.lock().unwrap_or_else(|p| p.into_inner());
        let estimate = by_route.get(route).copied().unwrap_or(MIN_HINT);
        estimate.min(remaining).max(MIN_HINT)
    }

    /// Gives an in-flight 409 the hint for `route` as its `Retry-After` (header and
    /// body); any other response is returned as it is.
    pub(crate) async fn hint_response(&self, route: &str, res: Response) -> Response {
        let Some(InFlightFor(remaining)) = res.extensions().get::<InFlightFor>().copied() else {
            return res;
        };
        if res.status() != StatusCode::CONFLICT {
            return res;
        }
        let hint = self.hint(route, remaining);
        let (mut parts, body) = res.into_parts();
        parts
            .headers
            .insert(RETRY_AFTER, HeaderValue::from(retry_secs(hint)));
        let Ok(bytes) = axum::body::to_bytes(body, MAX_PROBLEM_BYTES).await else {
            // Larger than any problem of idem's, or unreadable: nothing to rewrite.
            return Response::from_parts(parts, Body::empty());
        };
        let Ok(problem) = serde_json::from_slice::<Problem>(&bytes) else {
            // The application's own body: the header alone carries the hint.
            return Response::from_parts(parts, Body::from(bytes));
        };
        let body =
            serde_json::to_vec(&problem.retry_after(hint)).unwrap_or_else(|_| bytes.to_vec());
        parts.headers.remove(http::header::CONTENT_LENGTH);
        Response::from_parts(parts, Body::from(body))
    }
}

/// The route a handler-style request is estimated under: its method and axum's
/// `MatchedPath` (a template, one per route), kept unformatted until needed.
pub(crate) struct Route(Method, MatchedPath);

impl Route {
    /// The request's route; `None` outside a matched route.
    pub(crate) fn of(method: &Method, extensions: &http::Extensions) -> Option<Route> {
        let path = extensions.get::<MatchedPath>()?;
        Some(Route(method.clone(), path.clone()))
    }

    /// `POST /payments`.
    pub(crate) fn name(&self) -> String {
        format!("{} {}", self.0, self.1.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hint_follows_the_route_within_its_bounds() {
        let d = Durations::default();
        let lease = Duration::from_secs(60);
        assert_eq!(d.hint("POST /a", lease), MIN_HINT, "nothing known yet");
        d.observe("POST /a", Duration::from_secs(4));
        assert_eq!(d.hint("POST /a", lease), Duration::from_secs(4));
        d.observe("POST /a", Duration::from_secs(8));
        assert_eq!(d.hint("POST /a", lease), Duration::from_secs(5));
        assert_eq!(
            d.hint("POST /a", Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        d.observe("POST /b", Duration::from_millis(30));
        assert_eq!(d.hint("POST /b", lease), MIN_HINT);
        assert_eq!(d.hint("POST /c", Duration::from_millis(10)), MIN_HINT);
    }
}
