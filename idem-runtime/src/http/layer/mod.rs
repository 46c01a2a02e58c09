//! `IdempotencyLayer`: the `Idempotency-Key` behaviour for a whole router.

use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::header::{self, HeaderName};
use http::{Method, StatusCode};

use super::estimate::Durations;
use super::limits::Budget;
use super::problem::{Problem, Render};
use crate::ClaimLimit;
use crate::idem::Idem;
use crate::limit::ClaimLimiter;
use crate::op::InFlight;
use codec::{ENVELOPE_BYTES, cap_for, largest_recordable};

// One file a concern: the tower service and the request's way through it, the
// recording of a response the routes made, and the record's format.
mod codec;
mod record;
mod service;
pub(super) mod status;

pub use service::IdempotencyService;
pub use status::status_routes;

/// Makes the requests below it idempotent by their `Idempotency-Key` header, without
/// touching handlers.
///
/// For each request whose method is covered (POST and PATCH by default; others pass
/// through untouched):
/// - the key comes from the header (missing or invalid: 400) and the scope from the
///   [`Principal`](super::Principal) the application's auth layer put in the request's extensions (none:
///   500, the request does not run; there is no global scope);
/// - the operation is named by its route: `"POST /v1/payments"`, the method and the
///   route's template as axum matched it (`MatchedPath`, nest prefixes included), or
///   the request's full path where no route matched. So one key on two routes is two
///   operations, each answered with its own response, however the routers are nested.
///   (Wrapped around a whole `Router` from outside, the layer runs before routing, so a
///   route with path parameters gets a name per path: prefer `route_layer`, or a name.)
///   [`name`](Self::name) sets one name for every route below instead, on purpose: the
///   same key on two of them is then a 422;
/// - the request is fingerprinted, so the key reused with another request is a 422:
///   its method, its full path as the client sent it (axum's `OriginalUri`, so a nest
///   prefix counts), its query (decoded, pairs sorted by name: `?b=2&a=1` is
///   `?a=1&b=%32`; a repeated name's values keep their order), its `Content-Type`
///   (media type and parameter names lowercased, parameters sorted) and its body: a
///   JSON body (`application/json`, `+json` types) by its content (key order and
///   whitespace do not count, number literals do), an
///   `application/x-www-form-urlencoded` body by its pairs as a query is, any other by
///   its bytes. A JSON body that repeats a member name within one object is refused
///   with a 422 before anything runs: JSON readers disagree on which member counts
///   (serde_json's `Value` keeps the last, a derived struct refuses the body), so no
///   fingerprint could stand for what the route will read;
/// - the body is buffered for that within bounds: a `Content-Length` over
///   [`max_request_bytes`](Self::max_request_bytes) is a 413 before a byte is read, a
///   body still arriving after [`body_timeout`](Self::body_timeout) a 408, and bodies
///   past the layer's [`buffer_budget`](Self::buffer_budget), counted across every
///   request in it at once, a 503 with `Retry-After`. None of these runs the request;
/// - the first request runs the routes below and gets their response as they made
///   it. The response is recorded if [`record_status`](Self::record_status) says so (by
///   default every answer once the handler may have started, 5xx included: 2xx, 3xx,
///   5xx, 402 and 410, see [`records_by_default`](Self::records_by_default)), and
///   then replayed to every retry with `Idempotent-Replayed: true`: status, the
///   [recorded headers](Self::record_header) and body, byte for byte (other headers,
///   such as a request id, go to the first answer only). A JSON body is recorded as
///   JSON, other UTF-8 text as a string, other bytes as base64, and every response up
///   to [`max_response_bytes`](Self::max_response_bytes) fits the store's outcome cap
///   once recorded. Any other response (a framework's 400, 405, 413, 415 or 422, an
///   authorization refusal, a 429, a status named by
///   [`release_status`](Self::release_status)) is passed on unrecorded and the key
///   released: the corrected retry runs;
/// - a retry while the first request runs gets 409 at once (the draft's behaviour; see
///   [`in_flight`](Self::in_flight)), with a `Retry-After` of about how long the
///   route's requests take: a running average of the requests that ran, at least 1 s
///   and at most what is left of the running request's lease (1 s until one has
///   finished);
/// - with [`limit_claims`](Self::limit_claims), a caller's new keys beyond the limit
///   get 429 with `Retry-After` (replays are never limited);
/// - the request runs in its own task, so it finishes and records its outcome even if
///   the client disconnects, and the client's retry replays it
///   ([`run_to_completion`](Self::run_to_completion)).
///
/// The layer's own answers (400, 408, 409, 413, 422, 429, 500, 503 above) are
/// `application/problem+json` unless [`problem_response`](Self::problem_response)
/// renders them in the application's shape. None of them is recorded.
///
/// Put it inside the auth layer (so the principal is set when it runs), on the routes
/// that need it (`Router::route_layer` runs it only for matched routes).
///
/// ```
/// use axum::{Router, routing::post};
/// use idem_runtime::Idem;
/// use idem_runtime::http::IdempotencyLayer;
/// use std::time::Duration;
/// # async fn create() -> &'static str { "created" }
///
/// let idem = Idem::memory();
/// let app: Router = Router::new()
///     .route("/orders", post(create))
///     .route_layer(IdempotencyLayer::new(idem).retain(Duration::from_secs(86400)));
/// // .layer(your_auth_layer) -- it must set an `idem_runtime::http::Principal`
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    cfg: Config,
}

#[derive(Clone, Debug)]
struct Config {
    idem: Idem,
    /// `None`: named per route.
    name: Option<String>,
    retain: Duration,
    lease: Duration,
    in_flight: InFlight,
    methods: Vec<Method>,
    require_key: bool,
    max_request_bytes: usize,
    body_timeout: Duration,
    budget: Budget,
    claims: Option<Arc<ClaimLimiter>>,
    max_response_bytes: usize,
    recorded_headers: Vec<HeaderName>,
    record_status: fn(StatusCode) -> bool,
    /// Statuses released whatever `record_status` says.
    released: Vec<StatusCode>,
    /// `None`: problem+json.
    render: Option<Render>,
    spawn: bool,
    /// How long each route's requests take: the `Retry-After` of a 409.
    durations: Arc<Durations>,
    /// Requests answered `202` once they outlive a bound, when the routes accept them.
    accept: Option<status::Accept>,
}

impl IdempotencyLayer {
    /// The layer over `idem`'s store, with the defaults: operations named per route,
    /// retain 24 hours, lease 60 seconds, in-flight retries rejected at once, POST and
    /// PATCH covered, the key required, request bodies up to 1 MiB read within 30
    /// seconds and 64 MiB of them buffered at once, no claim limit, responses up to what
    /// the store's outcome cap holds once recorded (see
    /// [`max_response_bytes`](Self::max_response_bytes)), statuses recorded as
    /// [`records_by_default`](Self::records_by_default) says (5xx included), headers
    /// `content-type`, `location`, `content-language` and `etag` recorded, the layer's
    /// own refusals answered as problem+json, requests run to completion.
    ///
    /// # Panics
    ///
    /// If the store's outcome cap (`IdemBuilder::max_outcome_bytes`) is under 64 bytes,
    /// too small for even an empty recorded response.
    pub fn new(idem: Idem) -> Self {
        let cap = idem.max_outcome_bytes();
        assert!(
            cap >= ENVELOPE_BYTES,
            "IdempotencyLayer: the store's outcome cap of {cap} bytes cannot hold even an empty \
             recorded response ({ENVELOPE_BYTES} bytes); raise it with \
             `IdemBuilder::max_outcome_bytes` (the default is 64 KiB)"
        );
        let max_response_bytes = largest_recordable(cap);
        IdempotencyLayer {
            cfg: Config {
                idem,
                name: None,
                retain: Duration::from_secs(24 * 3600),
                lease: Duration::from_secs(60),
                in_flight: InFlight::Reject,
                methods: vec![Method::POST, Method::PATCH],
                require_key: true,
                max_request_bytes: 1 << 20,
                body_timeout: Duration::from_secs(30),
                budget: Budget::new(64 << 20),
                claims: None,
                max_response_bytes,
                recorded_headers: vec![
                    header::CONTENT_TYPE,
                    header::LOCATION,
                    header::CONTENT_LANGUAGE,
                    header::ETAG,
                ],
                record_status: Self::records_by_default,
                released: Vec::new(),
                render: None,
                spawn: true,
                durations: Arc::default(),
                accept: None,
            },
        }
    }

    /// One operation name for every route below (default: a name per route, the method
    /// and the matched route, such as `POST /v1/payments`). Routes under one name share
    /// their keys on purpose: a key reused on another route of it is a 422, since the
    /// path is fingerprinted. A name also keeps a route's records when it is renamed or
    /// moved.
    ///
    /// ```
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// let layer = IdempotencyLayer::new(Idem::memory()).name("payments");
    /// ```
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.cfg.name = Some(name.into());
        self
    }

    /// How long a response is kept and replayed (default 24 hours): at least the
    /// longest time your clients retry.
    pub fn retain(mut self, retain: Duration) -> Self {
        self.cfg.retain = retain;
        self
    }

    /// How long a running request owns its key before another may take over (default
    /// 60 seconds, renewed while it runs).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.cfg.lease = lease;
        self
    }

    /// What a retry does while the first request runs: [`InFlight::Reject`] (default,
    /// 409 at once) or [`InFlight::Wait`] (wait for the outcome, then 409).
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.cfg.in_flight = in_flight;
        self
    }

    /// The methods made idempotent (default POST and PATCH); others pass through.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.cfg.methods = methods.into_iter().collect();
        self
    }

    /// Whether a covered request without the header is refused with 400 (default) or
    /// passed through unprotected.
    pub fn require_key(mut self, require: bool) -> Self {
        self.cfg.require_key = require;
        self
    }

    /// The largest request body buffered for the fingerprint (default 1 MiB); larger is
    /// a 413 and the request does not run. A declared `Content-Length` over it is
    /// refused before the body is read. The [`buffer_budget`](Self::buffer_budget)
    /// bounds it too.
    pub fn max_request_bytes(mut self, max: usize) -> Self {
        self.cfg.max_request_bytes = max;
        self
    }

    /// How long a request body may take to arrive, whole (default 30 seconds); a body
    /// still arriving then is a 408 and the request does not run. It bounds how long a
    /// slow or stalled client holds its share of the [`buffer_budget`](Self::buffer_budget).
    ///
    /// ```
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(Idem::memory()).body_timeout(Duration::from_secs(10));
    /// ```
    pub fn body_timeout(mut self, timeout: Duration) -> Self {
        self.cfg.body_timeout = timeout;
        self
    }

    /// The request-body bytes this layer buffers at once, across all its requests
    /// (default 64 MiB): a body whose bytes (its declared `Content-Length` at once, else
    /// as they arrive) would go past it is refused with 503 and `Retry-After`, and the
    /// request does not run. It bounds the memory slow or many clients can hold; a
    /// body larger than the budget itself is a 413.
    ///
    /// The budget belongs to this layer value and its clones: two layers made with
    /// [`new`](Self::new) have one each.
    ///
    /// ```
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// let layer = IdempotencyLayer::new(Idem::memory()).buffer_budget(256 << 20);
    /// ```
    pub fn buffer_budget(mut self, bytes: usize) -> Self {
        self.cfg.budget = Budget::new(bytes);
        self
    }

    /// Limits the new operations each scope (each [`Principal`](super::Principal)) starts: `burst` at
    /// once, then one more every `every`, as [`IdemBuilder::limit_new_claims`] with
    /// [`ClaimLimit::new`] does for this layer's routes (in place of any limit the
    /// `Idem` has). A request that would start a new operation over the limit is
    /// answered 429 with `Retry-After`, does not run and writes nothing; replays,
    /// in-flight answers, takeovers and 422s take nothing from it. Off by default. It
    /// bounds the records one caller can make the store keep, and the work a caller can
    /// start with fresh keys.
    ///
    /// The count is this process's, per layer value and its clones; with several
    /// instances, each allows its own. [`limit_new_claims`](Self::limit_new_claims)
    /// takes a [`ClaimLimit`] instead, which may be [shared](ClaimLimit::shared) through
    /// the store.
    ///
    /// ```
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// # use std::time::Duration;
    /// // 20 at once, then one every 3 seconds (20 a minute) per caller.
    /// let layer = IdempotencyLayer::new(Idem::memory()).limit_claims(20, Duration::from_secs(3));
    /// ```
    ///
    /// # Panics
    ///
    /// If `burst` is 0 or `every` is zero: the first would refuse every request, the
    /// second none.
    ///
    /// [`IdemBuilder::limit_new_claims`]: crate::IdemBuilder::limit_new_claims
    pub fn limit_claims(self, burst: u32, every: Duration) -> Self {
        self.limit_new_claims(ClaimLimit::new(burst, every))
    }

    /// Limits the new operations started through this layer as `limit` says, in place of
    /// any limit the `Idem` has: per scope (the [`Principal`](super::Principal)) unless
    /// the limit is [keyed](ClaimLimit::keyed_by) otherwise, and per process unless it is
    /// [shared](ClaimLimit::shared) through the store.
    ///
    /// ```
    /// # use idem_runtime::{ClaimLimit, Idem, http::IdempotencyLayer};
    /// # use std::time::Duration;
    /// let layer = IdempotencyLayer::new(Idem::memory())
    ///     .limit_new_claims(ClaimLimit::new(20, Duration::from_secs(3)));
    /// ```
    ///
    /// # Panics
    ///
    /// If the limit is shared and the `Idem`'s store cannot hold the count.
    pub fn limit_new_claims(mut self, limit: ClaimLimit) -> Self {
        assert!(
            !limit.is_shared() || self.cfg.idem.store().shares_claim_counts(),
            "IdempotencyLayer::limit_new_claims: a shared claim limit needs a store that \
             can hold the count (PostgreSQL or Redis); drop `ClaimLimit::shared` to count \
             per process"
        );
        self.cfg.idem.store().read_before_claims();
        self.cfg.claims = Some(Arc::new(ClaimLimiter::new(limit)));
        self
    }

    /// The largest response recorded. A response's size is its body's length plus, for
    /// each [recorded header](Self::record_header), its name's and value's lengths and
    /// 32 bytes (as HTTP/2 counts a header list). Default: the most the store's outcome
    /// cap always holds once recorded, about 3/4 of it (49,104 bytes under the default
    /// cap of 64 KiB), since a body that is not JSON is recorded in base64, 4/3 its size.
    ///
    /// A larger response cannot be replayed: the request ran, so its key moves to
    /// UNKNOWN for reconciliation and the client gets a 500. To record larger responses,
    /// raise the store's cap (`IdemBuilder::max_outcome_bytes`) and this with it.
    ///
    /// # Panics
    ///
    /// If `max` is over the default: a response that size might not fit the store's
    /// outcome cap once recorded. The message gives the cap it would need.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        let cap = self.cfg.idem.max_outcome_bytes();
        let limit = largest_recordable(cap);
        assert!(
            max <= limit,
            "IdempotencyLayer::max_response_bytes({max}) is over the {limit} bytes the store's \
             outcome cap of {cap} bytes always holds once recorded (bodies that are not JSON, \
             and header values, may be recorded in base64, 4/3 their size); lower it to at \
             most {limit}, or raise the cap with `IdemBuilder::max_outcome_bytes({needed})`",
            needed = cap_for(max),
        );
        self.cfg.max_response_bytes = max;
        self
    }

    /// Records and replays this response header too. A header that is not recorded
    /// reaches the first answer only, as the route set it.
    pub fn record_header(mut self, name: HeaderName) -> Self {
        if !self.cfg.recorded_headers.contains(&name) {
            self.cfg.recorded_headers.push(name);
        }
        self
    }

    /// Which statuses of the responses the routes below produce are recorded and
    /// replayed; the others are passed on and release the key, so a retry runs again.
    /// Default: [`records_by_default`](Self::records_by_default). Statuses named with
    /// [`release_status`](Self::release_status) are released whatever `record` says.
    ///
    /// ```
    /// use http::StatusCode;
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// // Also record 409s, for an API whose 409 is a final business answer.
    /// let layer = IdempotencyLayer::new(Idem::memory()).record_status(|status| {
    ///     IdempotencyLayer::records_by_default(status) || status == StatusCode::CONFLICT
    /// });
    /// ```
    pub fn record_status(mut self, record: fn(StatusCode) -> bool) -> Self {
        self.cfg.record_status = record;
        self
    }

    /// Passes `status` on unrecorded and releases the key, so the retry runs again: for
    /// a status the application answers only when nothing happened, such as a 503 from
    /// a load-shedding or circuit-breaking layer below this one that refuses before the
    /// handler starts. Call it again for each further status.
    ///
    /// Release only a status that never follows an effect. A 5xx after the handler ran
    /// is an outcome of unknown effect (the charge may be written, the email sent);
    /// releasing it lets a client that retries every 5xx with one key, as Stripe's
    /// clients do, run the effect again.
    ///
    /// ```
    /// use http::StatusCode;
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// // This API's 503 comes from its load shedder only, before any handler runs.
    /// let layer = IdempotencyLayer::new(Idem::memory())
    ///     .release_status(StatusCode::SERVICE_UNAVAILABLE);
    /// ```
    pub fn release_status(mut self, status: StatusCode) -> Self {
        if !self.cfg.released.contains(&status) {
            self.cfg.released.push(status);
        }
        self
    }

    /// The statuses recorded by default: every answer the routes produce once their
    /// handler may have started, as Stripe records them. That is 2xx, 3xx and 5xx,
    /// 402 Payment Required (a payment refused: the retry must not pay) and 410 Gone.
    ///
    /// A 5xx is recorded because the handler may have had its effect before it failed:
    /// its outcome is unknown, and a retry that ran the handler again could repeat the
    /// effect. The retry gets the recorded 5xx back; a client that wants the operation
    /// attempted again sends a new key. A status the application answers only when
    /// nothing happened can be released with [`release_status`](Self::release_status).
    ///
    /// The rest of 4xx is passed on unrecorded, its key released: 400, 401, 403, 404,
    /// 405, 411, 413, 415, 422 and the like are mostly refusals made before the
    /// operation ran (by the framework's extractors, routing or authorization), which
    /// the corrected retry must not get back; 408, 425 and 429 say "try again"; 409 is
    /// the draft's own "in progress, retry" and an optimistic-concurrency "retry", and
    /// 412 answers preconditions the fingerprint does not cover. 1xx is never recorded.
    ///
    /// What the layer answers itself before the routes run (a refused key, a body over
    /// its bounds, the store down, a request in flight, a key reused) is never recorded,
    /// whatever the policy.
    ///
    /// ```
    /// use http::StatusCode;
    /// use idem_runtime::http::IdempotencyLayer;
    /// assert!(IdempotencyLayer::records_by_default(StatusCode::CREATED));
    /// assert!(IdempotencyLayer::records_by_default(StatusCode::PAYMENT_REQUIRED));
    /// assert!(IdempotencyLayer::records_by_default(StatusCode::INTERNAL_SERVER_ERROR));
    /// assert!(IdempotencyLayer::records_by_default(StatusCode::SERVICE_UNAVAILABLE));
    /// assert!(!IdempotencyLayer::records_by_default(StatusCode::UNSUPPORTED_MEDIA_TYPE));
    /// assert!(!IdempotencyLayer::records_by_default(StatusCode::TOO_MANY_REQUESTS));
    /// ```
    pub fn records_by_default(status: StatusCode) -> bool {
        status.is_success()
            || status.is_redirection()
            || status.is_server_error()
            || status == StatusCode::PAYMENT_REQUIRED
            || status == StatusCode::GONE
    }

    /// Renders the layer's own refusals in the application's error shape: `render`
    /// gets each [`Problem`] the layer answers before or instead of the routes (key
    /// missing or invalid, body refused, too many claims, request in flight, key reused
    /// with another request, store down, outcome unknown, no principal) and makes the
    /// response, with the status it chooses. Default: the problem as
    /// `application/problem+json`.
    ///
    /// [`Problem::kind`] tells the cases apart (one of the [`types`](super::types)
    /// names), [`Problem::message`] says what happened and what to do, and
    /// `retry_after` is set where the client should wait: the layer adds the
    /// `Retry-After` header from it unless `render` set one. Responses of the routes,
    /// recorded or replayed, are never passed to it. The handler style answers in the
    /// same shape through [`error_response`](super::error_response).
    ///
    /// A Stripe-shaped API, whose clients read an `error` object:
    ///
    /// ```
    /// use axum::{Json, Router, response::{IntoResponse, Response}, routing::post};
    /// use idem_runtime::Idem;
    /// use idem_runtime::http::{IdempotencyLayer, Problem, types};
    /// use serde_json::json;
    /// # async fn create() -> &'static str { "created" }
    ///
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
    /// let app: Router = Router::new()
    ///     .route("/v1/charges", post(create))
    ///     .route_layer(IdempotencyLayer::new(Idem::memory()).problem_response(stripe_error));
    /// ```
    pub fn problem_response<F>(mut self, render: F) -> Self
    where
        F: Fn(&Problem) -> Response + Send + Sync + 'static,
    {
        self.cfg.render = Some(Render(Arc::new(render)));
        self
    }

    /// Answers a request whose handler has not finished within `after` with `202
    /// Accepted`, a `Location` naming its status resource and a `Retry-After`, and lets
    /// the handler run on, detached from the connection: its claim renewed, its response
    /// recorded when it ends, which the status resource ([`status_routes`]) then serves.
    /// A handler that ends in time answers as without this. A duplicate that arrives
    /// while the operation runs gets the same `202` and `Location` instead of the
    /// in-flight answer; another payload under the key is still a 422.
    ///
    /// At most [`max_detached`](Self::max_detached) handlers run detached at once; past
    /// that a request is answered as any other in flight (it waits for its handler).
    /// Mount the status resource at [`status_path`](Self::status_path) (`/operations`
    /// by default), inside the same auth layer, and give the `Idem` a
    /// [`status_secret`](crate::IdemBuilder::status_secret) (or a `hash_keys` secret),
    /// which keys the status URLs. On shutdown, [`drain`](Self::drain) waits for the
    /// detached handlers; one still running when the process stops is left to its
    /// lease, and the client's retry of the original request takes it over.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{Router, routing::post};
    /// use idem_runtime::Idem;
    /// use idem_runtime::http::{IdempotencyLayer, status_routes};
    /// # async fn payout() {}
    ///
    /// let idem = Idem::builder().status_secret("x".repeat(32)).memory();
    /// let layer = IdempotencyLayer::new(idem.clone()).accept_after(Duration::from_secs(2));
    /// let app: Router = Router::new()
    ///     .route("/payouts", post(payout))
    ///     .layer(layer.clone())
    ///     .nest("/operations", status_routes(&idem));
    /// // In the auth layer's place: `.layer(auth)` around both.
    /// ```
    ///
    /// # Panics
    ///
    /// If the `Idem` has neither a `status_secret` nor a `hash_keys` secret.
    pub fn accept_after(mut self, after: Duration) -> Self {
        assert!(
            self.cfg.idem.status_secret().is_some(),
            "IdempotencyLayer::accept_after: the status URLs are keyed with a secret; set \
             `IdemBuilder::status_secret` (or `hash_keys`) on the `Idem`"
        );
        self.cfg.accept = Some(status::Accept::new(after, self.cfg.accept.take()));
        self
    }

    /// Where the status resource of accepted requests is nested (default
    /// `/operations`): their `Location` is this path, `/`, and the token. Call after
    /// [`accept_after`](Self::accept_after).
    ///
    /// # Panics
    ///
    /// Before `accept_after`.
    pub fn status_path(mut self, path: &str) -> Self {
        let accept = self.cfg.accept.as_mut().expect(
            "IdempotencyLayer::status_path: call `accept_after` first; without it no \
             request is accepted",
        );
        accept.set_path(path);
        self
    }

    /// How many handlers may run detached at once (default 1024). Call after
    /// [`accept_after`](Self::accept_after).
    ///
    /// # Panics
    ///
    /// Before `accept_after`.
    pub fn max_detached(mut self, max: usize) -> Self {
        let accept = self.cfg.accept.as_mut().expect(
            "IdempotencyLayer::max_detached: call `accept_after` first; without it no \
             handler runs detached",
        );
        accept.set_max(max);
        self
    }

    /// Waits, up to `within`, for the handlers this layer (and its clones) detached to
    /// end; `true` if none is left. Call it once the server stopped taking requests,
    /// such as after axum's `serve(..).with_graceful_shutdown(..)` returned: a handler
    /// still running after it is left to its lease.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use idem_runtime::{Idem, http::IdempotencyLayer};
    /// # async fn f(
    /// #     listener: tokio::net::TcpListener,
    /// #     app: axum::Router,
    /// #     layer: IdempotencyLayer,
    /// #     stop: impl std::future::Future<Output = ()> + Send + 'static,
    /// # ) {
    /// // `stop`: a signal, such as `tokio::signal::ctrl_c`.
    /// axum::serve(listener, app)
    ///     .with_graceful_shutdown(stop)
    ///     .await
    ///     .unwrap();
    /// layer.drain(Duration::from_secs(30)).await;
    /// # }
    /// ```
    pub async fn drain(&self, within: Duration) -> bool {
        match &self.cfg.accept {
            Some(accept) => accept.drain(within).await,
            None => true,
        }
    }

    /// Whether a request runs on when its client disconnects (default `true`).
    /// Without it, a disconnect cancels the request mid-way and its key stays claimed
    /// until the lease lapses.
    pub fn run_to_completion(mut self, spawn: bool) -> Self {
        self.cfg.spawn = spawn;
        self
    }
}

impl Config {
    /// One of the layer's own answers, in the application's shape if it gave one.
    fn answer(&self, problem: Problem) -> Response {
        match &self.render {
            Some(render) => render.answer(problem),
            None => problem.into_response(),
        }
    }

    /// Whether a response of the routes with `status` is recorded.
    fn records(&self, status: StatusCode) -> bool {
        (self.record_status)(status) && !self.released.contains(&status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "IdemBuilder::max_outcome_bytes(87448)")]
    fn a_limit_the_cap_may_not_hold_is_refused_at_construction() {
        let _ = IdempotencyLayer::new(crate::Idem::memory()).max_response_bytes(64 * 1024);
    }
}
