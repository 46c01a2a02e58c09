//! RFC 9457 problem details, and the HTTP answer to each [`IdemError`].

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use serde::{Deserialize, Serialize};

use super::rejection::KeyRejection;
use crate::error::IdemError;

/// The kinds of problem idem answers with, one per case: each is a name that
/// [`type_uri`] puts under the base [`set_type_base`] chose (by default
/// [`DEFAULT_TYPE_BASE`]) to make the problem's `type`. Clients may match on the `type`;
/// [`Problem::is`] matches a problem against a name.
pub mod types {
    /// 400: the `Idempotency-Key` header is missing or invalid (the `rule` member says
    /// which rule it broke).
    pub const INVALID_KEY: &str = "invalid-idempotency-key";
    /// 409: a request with this key is still being processed; retry after `Retry-After`.
    pub const IN_FLIGHT: &str = "in-flight";
    /// 422: the key was first used with another request (method, path, query, media
    /// type or body).
    pub const KEY_REUSED: &str = "key-reused";
    /// 503: the idempotency store could not be reached; the request did not run.
    pub const STORE_UNAVAILABLE: &str = "store-unavailable";
    /// 500: an earlier request with this key may have had its effect and is being
    /// reconciled; do not send the request again with a new key.
    pub const OUTCOME_UNKNOWN: &str = "outcome-unknown";
    /// 500: this attempt lost its claim to a newer one (its lease lapsed); a retry gets
    /// that attempt's outcome.
    pub const SUPERSEDED: &str = "superseded";
    /// 413: the request body is over the layer's cap.
    pub const BODY_TOO_LARGE: &str = "body-too-large";
    /// 400: the request body could not be read.
    pub const BODY_UNREADABLE: &str = "body-unreadable";
    /// 408: the request body did not arrive within the layer's read timeout.
    pub const BODY_TIMEOUT: &str = "body-timeout";
    /// 503: the layer holds as many request bodies as its buffer budget allows; retry
    /// after `Retry-After`.
    pub const BUSY: &str = "busy";
    /// 429: this caller started more new idempotent requests than the layer's claim
    /// limit allows; retry after `Retry-After` (replays are not limited).
    pub const TOO_MANY_CLAIMS: &str = "too-many-claims";
    /// 404: no operation of the caller's has this status URL (the status resource,
    /// [`status_routes`](crate::http::status_routes)).
    pub const NO_SUCH_OPERATION: &str = "no-such-operation";
    /// 409: an accepted operation's process stopped before it ended; retry the
    /// original request to resume it.
    pub const OPERATION_INTERRUPTED: &str = "operation-interrupted";
    /// 500: the route runs idempotent requests but no principal was set by the
    /// application's authentication (a wiring error; never run under a global scope).
    pub const NO_PRINCIPAL: &str = "no-principal";
    /// 422: the JSON request body repeats a member name within one object, which JSON
    /// readers take differently (the first, the last, or an error); the request did not
    /// run. Send each member once.
    pub const AMBIGUOUS_BODY: &str = "ambiguous-body";
    /// 500: idem is misconfigured or a recorded outcome cannot be read.
    pub const INTERNAL: &str = "internal";
}

/// The base of idem's problem `type` URIs unless [`set_type_base`] chose another: a URN
/// that names no web domain, so no page is promised. Give a base of your own (such as
/// `https://api.example.com/problems/`) to point clients at your documentation.
pub const DEFAULT_TYPE_BASE: &str = "urn:idem:problem:";

static TYPE_BASE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sets, once per process and before the first problem is answered, the base under
/// which idem's problem `type` URIs are made: `base` followed by a [`types`] name.
///
/// The base must start with a URI scheme (`https:`, `urn:`, `tag:`, …) and end with
/// `/` or `:`. It fails if a base was set already, or if a problem was already answered
/// with the default one (the same `type` must name the same case for the whole
/// process), unless `base` is the one in use.
///
/// ```standalone_crate
/// use idem_runtime::http::{set_type_base, type_uri, types};
/// set_type_base("https://api.example.com/problems/").unwrap();
/// assert_eq!(type_uri(types::IN_FLIGHT), "https://api.example.com/problems/in-flight");
/// assert!(set_type_base("urn:other:").is_err());
/// ```
pub fn set_type_base(base: &str) -> Result<(), String> {
    let scheme = base.split_once(':').map(|(s, _)| s).unwrap_or("");
    let valid_scheme = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !valid_scheme || !(base.ends_with('/') || base.ends_with(':')) {
        return Err(format!(
            "problem type base {base:?} must start with a URI scheme (such as `https:` or \
             `urn:`) and end with `/` or `:`"
        ));
    }
    let in_use = TYPE_BASE.get_or_init(|| base.to_owned());
    if in_use == base {
        Ok(())
    } else {
        Err(format!(
            "the problem type base is already {in_use:?}; set it once, at startup, before \
             the first request"
        ))
    }
}

/// The problem `type` URI for one of the [`types`] names: the base in use followed by
/// the name.
pub fn type_uri(name: &str) -> String {
    let base = TYPE_BASE.get_or_init(|| DEFAULT_TYPE_BASE.to_owned());
    format!("{base}{name}")
}

pub(super) use crate::error::whole_secs as retry_secs;

/// How long the call holding `e`'s key has left, where `e` says the key is in flight.
pub(super) fn in_flight_for(e: &IdemError) -> Option<Duration> {
    match e {
        IdemError::InFlight { retry_after, .. } | IdemError::TooManyWaiters { retry_after, .. } => {
            Some(*retry_after)
        }
        _ => None,
    }
}

/// On a response for a call that found its key in flight: how long the lease of the
/// call holding it has left, the most a retry could need to wait.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InFlightFor(pub(crate) Duration);

/// The `Retry-After` sent with a 503 for a store that is down.
pub const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// An RFC 9457 problem: answered as `application/problem+json`, with `Retry-After`
/// when [`retry_after`](Self::retry_after) is set.
///
/// An application that answers idem's problems in its own shape (see
/// [`error_response`] and `IdempotencyLayer::problem_response`) reads the `status`
/// ([`status_code`](Self::status_code)), the case ([`kind`](Self::kind), or the full
/// `type_uri`), what to tell the client ([`message`](Self::message), or `title` and
/// `detail`) and how long it should wait (the `retry_after` field, in seconds).
///
/// ```
/// use axum::response::IntoResponse;
/// use idem_runtime::http::{Problem, types};
/// use idem_runtime::IdemError;
/// use std::time::Duration;
///
/// let e = IdemError::InFlight { name: "pay".into(), retry_after: Duration::from_millis(1500) };
/// let p = Problem::from(&e);
/// assert_eq!((p.status, p.retry_after), (409, Some(2)));
/// assert!(p.is(types::IN_FLIGHT));
/// let response = e.into_response();
/// assert_eq!(response.headers()["retry-after"], "2");
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// A short summary of the kind of problem.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What happened this time and what to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Extension: the request header at fault.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Extension: the rule the header broke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// Seconds for the `Retry-After` header (also in the body, for clients that read
    /// only bodies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

impl Problem {
    /// A problem of one of idem's [`types`], its `type` made by [`type_uri`].
    pub(crate) fn of(status: StatusCode, name: &str, title: impl Into<String>) -> Self {
        Problem::new(status, type_uri(name), title)
    }

    /// Whether this problem is of the kind `name`, one of the [`types`].
    ///
    /// ```
    /// use idem_runtime::http::{Problem, types};
    /// use idem_runtime::IdemError;
    /// let p = Problem::from(IdemError::Mismatch { name: "pay".into() });
    /// assert!(p.is(types::KEY_REUSED));
    /// ```
    pub fn is(&self, name: &str) -> bool {
        self.type_uri == type_uri(name)
    }

    /// A problem with a status, a full type URI and a title.
    pub fn new(status: StatusCode, type_uri: impl Into<String>, title: impl Into<String>) -> Self {
        Problem {
            type_uri: type_uri.into(),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            header: None,
            rule: None,
            retry_after: None,
        }
    }

    /// Sets `detail`.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Sets `Retry-After`, in whole seconds rounded up (at least 1, so a client never
    /// retries at once in a loop).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(retry_secs(after));
        self
    }

    /// The status code (500 if `status` is not a valid code).
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The kind of problem: `type` without the base in use, so one of the [`types`]
    /// names for idem's own problems; `None` for a `type` under another base.
    ///
    /// ```
    /// use idem_runtime::http::{Problem, types};
    /// use idem_runtime::IdemError;
    /// let p = Problem::from(IdemError::Mismatch { name: "pay".into() });
    /// assert_eq!(p.kind(), Some(types::KEY_REUSED));
    /// ```
    pub fn kind(&self) -> Option<&str> {
        self.type_uri.strip_prefix(type_uri("").as_str())
    }

    /// What to tell a person: `detail` where it is set (what happened this time and
    /// what to do), else `title`.
    ///
    /// ```
    /// use idem_runtime::http::Problem;
    /// use idem_runtime::IdemError;
    /// let p = Problem::from(IdemError::Mismatch { name: "pay".into() });
    /// assert!(p.message().starts_with("this Idempotency-Key was first used"));
    /// ```
    pub fn message(&self) -> &str {
        self.detail.as_deref().unwrap_or(&self.title)
    }

    pub(crate) fn body_too_large(max: usize) -> Self {
        Problem::of(
            StatusCode::PAYLOAD_TOO_LARGE,
            types::BODY_TOO_LARGE,
            "Request body too large",
        )
        .detail(format!(
            "idempotent requests are buffered to be fingerprinted, at most {max} bytes; \
             the request did not run: send a smaller body"
        ))
    }

    pub(crate) fn body_timeout(timeout: Duration) -> Self {
        Problem::of(
            StatusCode::REQUEST_TIMEOUT,
            types::BODY_TIMEOUT,
            "Request body too slow",
        )
        .detail(format!(
            "the request body did not arrive within {} ms; the request did not run: send \
             it again, whole",
            timeout.as_millis()
        ))
    }

    pub(crate) fn busy(retry_after: Duration) -> Self {
        Problem::of(StatusCode::SERVICE_UNAVAILABLE, types::BUSY, "Server busy")
            .detail(
                "too many request bodies are being buffered at once; the request did not run: \
             retry it with the same Idempotency-Key after Retry-After seconds",
            )
            .retry_after(retry_after)
    }

    pub(crate) fn too_many_claims(retry_after: Duration) -> Self {
        Problem::of(
            StatusCode::TOO_MANY_REQUESTS,
            types::TOO_MANY_CLAIMS,
            "Too many new requests",
        )
        .detail(
            "you started more new idempotent requests than this server allows for now; the \
             request did not run: retry it with the same Idempotency-Key after Retry-After \
             seconds",
        )
        .retry_after(retry_after)
    }

    pub(crate) fn body_unreadable() -> Self {
        Problem::of(
            StatusCode::BAD_REQUEST,
            types::BODY_UNREADABLE,
            "Request body could not be read",
        )
    }

    pub(crate) fn no_principal() -> Self {
        Problem::of(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::NO_PRINCIPAL,
            "No principal for an idempotent request",
        )
        .detail(
            "the server did not identify the caller, and idempotency keys are scoped per \
             caller; the request did not run",
        )
    }

    pub(crate) fn ambiguous_body(member: &str) -> Self {
        // A client's member name may be as long as its body: shown in part.
        const SHOWN: usize = 64;
        let cut = member
            .char_indices()
            .nth(SHOWN)
            .map_or(member.len(), |(i, _)| i);
        let ellipsis = if cut < member.len() { "…" } else { "" };
        Problem::of(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::AMBIGUOUS_BODY,
            "Request body ambiguous",
        )
        .detail(format!(
            "the JSON body repeats the member {:?}{ellipsis} within one object, which JSON \
             readers take differently (the first, the last, or an error); the request did \
             not run: send each member once",
            &member[..cut]
        ))
    }

    pub(crate) fn outcome_unknown() -> Self {
        Problem::of(
            StatusCode::INTERNAL_SERVER_ERROR,
            types::OUTCOME_UNKNOWN,
            "Outcome being reconciled",
        )
        .detail(
            "a request with this key may have had its effect, but its outcome was not \
             recorded; it is being reconciled, so do not repeat it with a new key",
        )
    }
}

impl From<KeyRejection> for Problem {
    fn from(r: KeyRejection) -> Self {
        let mut p = Problem::of(
            StatusCode::BAD_REQUEST,
            types::INVALID_KEY,
            "Invalid Idempotency-Key header",
        )
        .detail(r.detail());
        p.header = Some("Idempotency-Key".into());
        p.rule = Some(r.rule().into());
        p
    }
}

impl From<&IdemError> for Problem {
    fn from(e: &IdemError) -> Self {
        // Details are written here rather than taken from the error's message: those
        // name operations and carry database errors, which are the operator's, not the
        // client's.
        match e {
            IdemError::InFlight { retry_after, .. }
            | IdemError::TooManyWaiters { retry_after, .. } => Problem::of(
                StatusCode::CONFLICT,
                types::IN_FLIGHT,
                "Request in progress",
            )
            .detail(
                "a request with this Idempotency-Key is still being processed; retry \
                 after Retry-After seconds to get its outcome",
            )
            .retry_after(*retry_after),
            IdemError::Mismatch { .. } => Problem::of(
                StatusCode::UNPROCESSABLE_ENTITY,
                types::KEY_REUSED,
                "Idempotency-Key reused",
            )
            .detail(
                "this Idempotency-Key was first used with a different request; use a new \
                 key for a new request",
            ),
            IdemError::RateLimited { retry_after, .. } => Problem::too_many_claims(*retry_after),
            IdemError::KeyTooLong { len, .. } => KeyRejection::TooLong { len: *len }.into(),
            IdemError::EmptyKey { .. } => KeyRejection::Empty.into(),
            IdemError::Store { .. } | IdemError::NoStore => Problem::of(
                StatusCode::SERVICE_UNAVAILABLE,
                types::STORE_UNAVAILABLE,
                "Idempotency store unavailable",
            )
            .detail("the request did not run; retry it with the same Idempotency-Key")
            .retry_after(STORE_RETRY_AFTER),
            IdemError::Unknown { .. }
            | IdemError::Unrecorded { .. }
            | IdemError::OutcomeTooLarge { in_doubt: true, .. } => Problem::outcome_unknown(),
            // A transactional handler's writes were rolled back with its claim.
            IdemError::OutcomeTooLarge { .. } => Problem::of(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::INTERNAL,
                "Response too large to record",
            )
            .detail(
                "the request was not applied: its response was too large to record, so its \
                 changes were undone; it may be retried with the same Idempotency-Key",
            ),
            // The recorded response is sealed under a key the keyring lacks, or altered:
            // it is not replayed, and the request does not run again.
            IdemError::Undecryptable { .. } => Problem::of(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::INTERNAL,
                "Recorded response unreadable",
            )
            .detail(
                "this request was processed, but its recorded response cannot be read by this \
                 server; it was not applied again: do not retry it under a new \
                 Idempotency-Key",
            ),
            IdemError::Fenced { .. } => Problem::of(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::SUPERSEDED,
                "Attempt superseded",
            )
            .detail(
                "this attempt took too long and another took over; retry with the same \
                 Idempotency-Key to get that attempt's outcome",
            ),
            _ => Problem::of(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::INTERNAL,
                "Idempotency error",
            ),
        }
    }
}

impl From<IdemError> for Problem {
    fn from(e: IdemError) -> Self {
        Problem::from(&e)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut res = (self.status_code(), body).into_response();
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after {
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// The draft's status codes: 409 in flight (with `Retry-After`), 422 key reused, 400
/// bad key, 503 store down (with `Retry-After`; the body did not run), 500 outcome
/// unknown or unrecorded; every body a [`Problem`]. Server-side cases are logged with
/// the full error, which the response does not carry. To answer in the application's
/// own error shape instead, see [`error_response`].
impl IntoResponse for IdemError {
    fn into_response(self) -> Response {
        error_response(&self, |problem| problem.clone().into_response())
    }
}

/// Answers `e` in the application's own error shape: `render` turns its [`Problem`]
/// (status, [`kind`](Problem::kind), [`message`](Problem::message), `retry_after`) into
/// the response. For the handler style, in the `IntoResponse` of the error type whose
/// `From<IdemError>` the handlers use; `IdempotencyLayer` takes the same function as
/// [`problem_response`](super::IdempotencyLayer::problem_response).
///
/// Whatever `render` makes, the response keeps what clients and
/// [`IdempotentHandlerLayer`](super::IdempotentHandlerLayer) rely on: a `Retry-After`
/// header where the problem has one and `render` set none, and the mark that lets the
/// handler layer fit a 409's `Retry-After` to the route. Server-side cases (5xx) are
/// logged with the full error, which the problem does not carry.
///
/// ```
/// use axum::{Json, response::{IntoResponse, Response}};
/// use idem_runtime::http::{Problem, error_response, types};
/// use idem_runtime::IdemError;
/// use serde_json::json;
///
/// /// Stripe's error shape.
/// fn stripe_error(p: &Problem) -> Response {
///     let kind = match p.kind() {
///         Some(types::KEY_REUSED | types::IN_FLIGHT | types::INVALID_KEY) => "idempotency_error",
///         Some(_) if p.status < 500 => "invalid_request_error",
///         _ => "api_error",
///     };
///     let body = json!({"error": {"type": kind, "message": p.message()}});
///     (p.status_code(), Json(body)).into_response()
/// }
///
/// enum ApiError { Idem(IdemError) }
/// impl From<IdemError> for ApiError {
///     fn from(e: IdemError) -> Self { ApiError::Idem(e) }
/// }
/// impl IntoResponse for ApiError {
///     fn into_response(self) -> Response {
///         match self {
///             ApiError::Idem(e) => error_response(&e, stripe_error),
///         }
///     }
/// }
///
/// let e = IdemError::InFlight { name: "pay".into(), retry_after: std::time::Duration::from_secs(3) };
/// let res = ApiError::from(e).into_response();
/// assert_eq!(res.status(), 409);
/// assert_eq!(res.headers()["retry-after"], "3");
/// assert_eq!(res.headers()["content-type"], "application/json");
/// ```
pub fn error_response(e: &IdemError, render: impl FnOnce(&Problem) -> Response) -> Response {
    let problem = Problem::from(e);
    log_server_side(e, &problem);
    let mut res = with_retry_after(&problem, render(&problem));
    if let Some(remaining) = in_flight_for(e) {
        // For the handler layer, which answers a hint from the route's durations.
        res.extensions_mut().insert(InFlightFor(remaining));
    }
    res
}

/// Logs `e` with its full message where its problem is a server-side one (5xx).
pub(super) fn log_server_side(e: &IdemError, problem: &Problem) {
    if problem.status >= 500 {
        tracing::error!(error = %e, "idempotent request failed");
    }
}

/// `res`, with the problem's `Retry-After` added where it has one and `res` has none.
pub(super) fn with_retry_after(problem: &Problem, mut res: Response) -> Response {
    if let Some(secs) = problem.retry_after
        && !res.headers().contains_key(RETRY_AFTER)
    {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

/// How an application renders idem's problems: a function shared by a layer's clones.
#[derive(Clone)]
pub(super) struct Render(pub(super) std::sync::Arc<dyn Fn(&Problem) -> Response + Send + Sync>);

impl std::fmt::Debug for Render {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Render(..)")
    }
}

impl Render {
    /// `problem` as the application renders it, `Retry-After` kept.
    pub(super) fn answer(&self, problem: Problem) -> Response {
        with_retry_after(&problem, (self.0)(&problem))
    }
}
