//! Long-running requests: the `202 Accepted` a route answers once its handler outlives
//! [`IdempotencyLayer::accept_after`](super::IdempotencyLayer::accept_after), and the
//! status resource ([`status_routes`]) its `Location` names.
//!
//! The token in the URL is a keyed digest of the operation's identity under the `Idem`'s
//! status secret, so every duplicate of a request gets the same `Location` and nobody
//! can guess another operation's. The way back from the token to the operation is a
//! record of its own, scoped by the principal: another principal's lookup finds nothing,
//! as for a token that never was. The accepted operation itself may have any scope (a
//! handler's `#[idempotent]` names its own).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::Mac;
use http::header::{CONTENT_TYPE, LOCATION, RETRY_AFTER};
use http::{HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::codec::{RECORD_VERSION, Recorded, upgrade};
use crate::http::key::IDEMPOTENT_REPLAYED;
use crate::http::principal::Principal;
use crate::http::problem::{Problem, log_server_side, retry_secs, types};
use crate::http::spawned::joined;
use crate::idem::Idem;
use crate::store::{OperationId, State as RecordState};

/// The longest `Retry-After` of a pending operation's status: its lease may run much
/// longer than the handler does.
const POLL_AFTER: Duration = Duration::from_secs(5);

/// The operation name of the records that lead from a token to its operation.
const TRACKER: &str = "idem.status";

/// Where an accepted operation is: its identity as stored, and what it records.
#[derive(Serialize, Deserialize)]
struct Tracked {
    scope: String,
    name: String,
    key: String,
    recorded: Recording,
}

/// What an accepted operation records.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Recording {
    /// The whole response (`IdempotencyLayer`), served as it was.
    Response,
    /// The handler's idempotent call's value (`#[idempotent]` handlers), served as JSON.
    Value,
}

/// Detached handlers a layer lets run at once unless told otherwise.
const DEFAULT_MAX_DETACHED: usize = 1024;

/// How a layer accepts long requests: after how long, where their status is, and the
/// handlers it lets run on detached at once.
#[derive(Clone, Debug)]
pub(crate) struct Accept {
    pub(crate) after: Duration,
    /// The path the status resource is nested at, without its trailing `/`.
    path: String,
    /// One permit a detached handler; `max` in all.
    detached: Arc<Semaphore>,
    max: usize,
}

impl Accept {
    /// Accepting after `after`, with the path and bound of `was` if set before.
    pub(crate) fn new(after: Duration, was: Option<Accept>) -> Accept {
        let (path, max) = match was {
            Some(a) => (a.path, a.max),
            None => ("/operations".to_owned(), DEFAULT_MAX_DETACHED),
        };
        Accept {
            after,
            path,
            detached: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    pub(crate) fn set_path(&mut self, path: &str) {
        self.path = path.trim_end_matches('/').to_owned();
    }

    pub(crate) fn set_max(&mut self, max: usize) {
        self.max = max;
        self.detached = Arc::new(Semaphore::new(max));
    }

    /// Waits up to `within` for every detached handler to end.
    pub(crate) async fn drain(&self, within: Duration) -> bool {
        let all = u32::try_from(self.max).unwrap_or(u32::MAX);
        tokio::time::timeout(within, self.detached.acquire_many(all))
            .await
            .is_ok_and(|permits| permits.is_ok())
    }

    /// The `202` for `target`, once the way from its token is recorded; `None` when it
    /// cannot be (no status secret, the store refused), so the request is answered as
    /// though the route did not accept it.
    pub(crate) async fn accepted(&self, target: &Target) -> Option<Response> {
        let Some(secret) = target.idem.status_secret() else {
            tracing::error!(
                "a route accepts long requests, but its `Idem` has no status secret; set \
                 `IdemBuilder::status_secret`"
            );
            return None;
        };
        let token = token(secret, &target.id);
        let tracked = track(
            &target.idem,
            &target.principal,
            &token,
            &target.id,
            target.retain,
            target.recorded,
        );
        if let Err(e) = tracked.await {
            tracing::warn!(error = %e, "cannot record a status URL; answering as in flight");
            return None;
        }
        Some(accepted(
            Some(&format!("{}/{token}", self.path)),
            self.after,
        ))
    }

    /// Runs `call` in its own task; if it has not ended after the bound, a detached
    /// slot is free and `target` (asked then) names its operation, answers `202` (the
    /// `Err`) and lets it run on.
    pub(crate) async fn run<F>(
        &self,
        call: F,
        target: impl FnOnce() -> Option<Target>,
    ) -> Result<F::Output, Response>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let mut task = tokio::spawn(call);
        if let Ok(ended) = tokio::time::timeout(self.after, &mut task).await {
            return Ok(joined(ended));
        }
        let Ok(permit) = self.detached.clone().try_acquire_owned() else {
            return Ok(joined(task.await));
        };
        let Some(target) = target() else {
            return Ok(joined(task.await));
        };
        let Some(res) = self.accepted(&target).await else {
            return Ok(joined(task.await));
        };
        // The slot is the task's until it ends; `drain` waits for every slot.
        tokio::spawn(async move {
            let _ = task.await;
            drop(permit);
        });
        Err(res)
    }
}

/// The operation a request is about, and whose request it is.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) idem: Idem,
    pub(crate) principal: Principal,
    pub(crate) id: OperationId,
    pub(crate) retain: Duration,
    pub(crate) recorded: Recording,
}

/// The status token of `id`: 128 bits of an HMAC under the status secret, URL-safe.
pub(crate) fn token(secret: &[u8], id: &OperationId) -> String {
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    for part in [&id.scope, &id.name, &id.key] {
        mac.update(&(part.len() as u64).to_be_bytes());
        mac.update(part.as_bytes());
    }
    URL_SAFE_NO_PAD.encode(&mac.finalize().into_bytes()[..16])
}

/// Records the way from `token` back to `id` for `principal`, kept for `retain`; a
/// second call (a duplicate, another instance) replays the first.
async fn track(
    idem: &Idem,
    principal: &Principal,
    token: &str,
    id: &OperationId,
    retain: Duration,
    recorded: Recording,
) -> Result<(), crate::IdemError> {
    let tracked = Tracked {
        scope: id.scope.clone(),
        name: id.name.clone(),
        key: id.key.clone(),
        recorded,
    };
    idem.operation(TRACKER, token)
        .scope(principal.as_str())
        .retain(retain)
        .fingerprint_none()
        .run(|| async move { Ok::<_, crate::IdemError>(tracked) })
        .await
        .map(drop)
}

/// The `202 Accepted` of an operation still running: when to ask again, and where
/// (the route's answer names the status resource; the resource's own answer does not).
fn accepted(location: Option<&str>, retry_after: Duration) -> Response {
    let body = match location {
        Some(location) => serde_json::json!({ "status": "pending", "location": location }),
        None => serde_json::json!({ "status": "pending" }),
    };
    let mut res = (StatusCode::ACCEPTED, body.to_string()).into_response();
    let headers = res.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(value) = location.and_then(|l| HeaderValue::from_str(l).ok()) {
        headers.insert(LOCATION, value);
    }
    headers.insert(RETRY_AFTER, HeaderValue::from(retry_secs(retry_after)));
    res
}

/// The status resource of requests a route accepted (`202`) with
/// [`IdempotencyLayer::accept_after`](super::IdempotencyLayer::accept_after): an axum
/// `Router` (for any state of the router it is nested in) answering `GET /{token}`, to
/// nest where the layer's
/// [`status_path`](super::IdempotencyLayer::status_path) says (`/operations` by
/// default), inside the same auth layer as the routes, since a token is the caller's
/// alone.
///
/// - `202 Accepted` with `Retry-After` while the operation runs;
/// - once it has ended, the recorded response (its status, recorded headers and body)
///   with `Idempotent-Replayed: true`; for a route of `#[idempotent]` handlers
///   ([`IdempotentHandlerLayer::accept_after`](crate::http::IdempotentHandlerLayer::accept_after)),
///   `200` with the recorded value, `{"status": "completed", "outcome": …}` (or
///   `{"status": "failed", "error": …}`), since the response is the handler's to make:
///   the original request's retry replays it whole;
/// - `404` for a token that is unknown, expired, forgotten, or another principal's (the
///   same answer, so a token reveals nothing to anyone else), and for an operation
///   whose handler's error released its key (a retry of the request runs it again);
/// - `409` (`operation-interrupted`) for one whose process stopped before it ended: its
///   lease has lapsed, and the next retry of the original request takes it over (the
///   status resource then follows that attempt);
/// - `500` (`outcome-unknown`) for one held for reconciliation, as the route answers.
///
/// A `GET` never runs a handler and never writes.
///
/// ```
/// use axum::Router;
/// use idem_runtime::Idem;
/// use idem_runtime::http::status_routes;
///
/// let idem = Idem::builder().status_secret("x".repeat(32)).memory();
/// let app: Router = Router::new().nest("/operations", status_routes(&idem));
/// ```
pub fn status_routes<S: Clone + Send + Sync + 'static>(idem: &Idem) -> Router<S> {
    Router::new()
        .route("/{token}", get(status))
        .with_state(idem.clone())
}

async fn status(State(idem): State<Idem>, Path(token): Path<String>, req: Request) -> Response {
    let Some(principal) = req.extensions().get::<Principal>() else {
        tracing::error!(
            "status_routes: no Principal in the request's extensions; is the auth layer \
             outside it?"
        );
        return Problem::no_principal().into_response();
    };
    match lookup(&idem, principal, &token).await {
        Ok(res) => res,
        Err(e) => {
            let problem = Problem::from(&e);
            log_server_side(&e, &problem);
            problem.into_response()
        }
    }
}

async fn lookup(
    idem: &Idem,
    principal: &Principal,
    token: &str,
) -> Result<Response, crate::IdemError> {
    let not_found = || {
        Problem::of(
            StatusCode::NOT_FOUND,
            types::NO_SUCH_OPERATION,
            "No such operation",
        )
        .detail("no operation of yours has this status URL, or it is no longer kept")
        .into_response()
    };
    // A token is URL-safe base64 of 16 bytes; anything else names nothing.
    if token.len() != 22 || URL_SAFE_NO_PAD.decode(token).is_err() {
        return Ok(not_found());
    }
    let tracker = idem.operation(TRACKER, token).scope(principal.as_str());
    let tracker_id = tracker.id();
    let Some(detail) = idem.get(tracker_id).await? else {
        return Ok(not_found());
    };
    let Some(outcome) = detail
        .outcome
        .filter(|_| detail.info.state == RecordState::Completed)
    else {
        return Ok(not_found());
    };
    let tracked: Tracked =
        serde_json::from_slice(&outcome.body).map_err(|e| crate::IdemError::Codec {
            name: TRACKER.into(),
            message: format!("cannot read a status record: {e}"),
        })?;
    let id = OperationId {
        scope: tracked.scope.clone(),
        name: tracked.name.clone(),
        key: tracked.key.clone(),
    };
    let Some(detail) = idem.get(&id).await? else {
        return Ok(not_found());
    };
    Ok(match detail.info.state {
        RecordState::InProgress => match detail.lease_remaining {
            Some(left) if !left.is_zero() => accepted(None, left.min(POLL_AFTER)),
            // Released with its steps kept, or lapsed: nothing runs it until the
            // original request is retried.
            _ => Problem::of(
                StatusCode::CONFLICT,
                types::OPERATION_INTERRUPTED,
                "Operation interrupted",
            )
            .detail(
                "the operation stopped before it ended; retry the original request with \
                 the same Idempotency-Key to resume it",
            )
            .into_response(),
        },
        RecordState::Unknown => Problem::outcome_unknown().into_response(),
        RecordState::Completed => {
            let Some(outcome) = detail.outcome else {
                return Ok(not_found());
            };
            let mut res = match tracked.recorded {
                Recording::Response => {
                    decode(&id.name, outcome.version, &outcome.body)?.into_response()
                }
                Recording::Value => value_response(&id.name, outcome.is_err, &outcome.body)?,
            };
            res.headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            res
        }
    })
}

/// A handler's recorded value: `200` with `{"status": "completed", "outcome": …}`, or
/// `{"status": "failed", "error": …}` for a recorded error. The original request's retry
/// replays the handler's full response.
fn value_response(name: &str, is_err: bool, body: &[u8]) -> Result<Response, crate::IdemError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| crate::IdemError::Codec {
            name: name.to_owned(),
            message: format!("cannot read a recorded value: {e}"),
        })?;
    let body = if is_err {
        serde_json::json!({ "status": "failed", "error": value })
    } else {
        serde_json::json!({ "status": "completed", "outcome": value })
    };
    let mut res = (StatusCode::OK, body.to_string()).into_response();
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(res)
}

/// A recorded response, as the layer recorded it (or an older schema, upgraded).
fn decode(name: &str, version: u32, body: &[u8]) -> Result<Recorded, crate::IdemError> {
    let codec = |e: serde_json::Error| crate::IdemError::Codec {
        name: name.to_owned(),
        message: format!("cannot read a recorded response: {e}"),
    };
    if version == RECORD_VERSION {
        return serde_json::from_slice(body).map_err(codec);
    }
    let value = serde_json::from_slice(body).map_err(codec)?;
    upgrade(name, version, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_the_operations_alone_and_the_secrets() {
        let id = |key: &str| OperationId {
            scope: "alice".into(),
            name: "POST /payouts".into(),
            key: key.into(),
        };
        let a = token(b"0123456789abcdef", &id("k1"));
        assert_eq!(a.len(), 22);
        assert_eq!(a, token(b"0123456789abcdef", &id("k1")));
        assert_ne!(a, token(b"0123456789abcdef", &id("k2")));
        assert_ne!(a, token(b"fedcba9876543210", &id("k1")));
    }
}
