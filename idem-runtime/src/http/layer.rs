//! `IdempotencyLayer`: the `Idempotency-Key` behaviour for a whole router.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::BoxError;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, OriginalUri};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use super::canonical::{BodyKind, Json, body_kind, canonical_form, content_types};
use super::estimate::Durations;
use super::handler::run_spawned;
use super::key::{IDEMPOTENT_REPLAYED, IdempotencyKey};
use super::limits::{Budget, Buffered, ClaimLimiter, read_body};
use super::principal::Principal;
use super::problem::{Problem, Render, in_flight_for, log_server_side};
use super::rejection::KeyRejection;
use crate::context::observe;
use crate::error::IdemError;
use crate::idem::Idem;
use crate::op::{Disposition, InFlight, MAX_KEY_BYTES};

/// Makes the requests below it idempotent by their `Idempotency-Key` header, without
/// touching handlers.
///
/// For each request whose method is covered (POST and PATCH by default; others pass
/// through untouched):
/// - the key comes from the header (missing or invalid: 400) and the scope from the
///   [`Principal`] the application's auth layer put in the request's extensions (none:
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

    /// Limits the new operations each scope (each [`Principal`]) starts: `burst` at
    /// once, then one more every `every` (a token bucket). A request over the limit is
    /// answered 429 with `Retry-After`, does not run, and its key is released; replays,
    /// in-flight answers and 422s take nothing from it. Off by default. It bounds the
    /// records one caller can make the store keep, and the work a caller can start with
    /// fresh keys.
    ///
    /// The count is this process's, per layer value and its clones; with several
    /// instances, each allows its own.
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
    pub fn limit_claims(mut self, burst: u32, every: Duration) -> Self {
        assert!(
            burst > 0 && !every.is_zero(),
            "IdempotencyLayer::limit_claims({burst}, {every:?}): both must be over zero; \
             to allow any number of claims, do not call it"
        );
        self.cfg.claims = Some(Arc::new(ClaimLimiter::new(burst, every)));
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

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            cfg: Arc::new(self.cfg.clone()),
        }
    }
}

/// The service [`IdempotencyLayer`] makes.
#[derive(Clone, Debug)]
pub struct IdempotencyService<S> {
    inner: S,
    cfg: Arc<Config>,
}

/// Takes a request with any body, as tower-http's layers do; the routes inside get it
/// as an axum [`Body`] holding the buffered bytes.
impl<S, B> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        // `Body::new` keeps an axum body as it is rather than boxing it again.
        let mut req = req.map(Body::new);
        // This layer sets `Idempotent-Replayed` itself: a handler below that extracts
        // the key needs no `IdempotentHandlerLayer`.
        req.extensions_mut().insert(super::key::ReplayHeaderSet);
        Box::pin(async move { Ok(handle(cfg, inner, req).await) })
    }
}

/// What a recorded response's record holds beyond its body and headers, at most: the
/// status, the field names, the body's tag and base64's padding.
const ENVELOPE_BYTES: usize = 64;

/// What each recorded header counts toward `max_response_bytes` beyond its name and
/// value: HTTP/2's per-field overhead (RFC 9113, section 6.5.2). It also covers the
/// header's framing in the record, so the record's size is bounded by the response's.
const HEADER_OVERHEAD: usize = 32;

/// The record's schema: JSON bodies as JSON, other bytes as base64, header values as
/// bytes. Version 1 (text or hex bodies, text header values) is read by [`upgrade`].
const RECORD_VERSION: u32 = 2;

/// The largest response a store whose outcome cap is `cap` always holds once recorded.
/// A response of size `n` records in at most `ENVELOPE_BYTES + 4n/3` bytes: a body is
/// recorded as it is (JSON), as an escaped string only when that is no longer than its
/// base64, or in base64 (`4⌈n/3⌉`); a header likewise, its framing within
/// `HEADER_OVERHEAD`.
fn largest_recordable(cap: usize) -> usize {
    cap.saturating_sub(ENVELOPE_BYTES) / 4 * 3
}

/// The outcome cap that records every response of up to `max` bytes.
fn cap_for(max: usize) -> usize {
    max.div_ceil(3)
        .saturating_mul(4)
        .saturating_add(ENVELOPE_BYTES)
}

/// A response as recorded: replayed with the same status, headers and body.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Recorded {
    status: u16,
    headers: Vec<(String, HeaderBytes)>,
    body: RecordedBody,
}

/// A body as recorded, in the most compact form that keeps it exact.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum RecordedBody {
    /// A JSON document, embedded as it is: readable in the store, and no larger there.
    Json(Box<RawValue>),
    /// UTF-8 text that is not JSON, where escaping it costs no more than base64 would.
    Text(String),
    /// Any other bytes.
    Base64(Base64),
}

impl PartialEq for RecordedBody {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (RecordedBody::Json(a), RecordedBody::Json(b)) => a.get() == b.get(),
            (RecordedBody::Text(a), RecordedBody::Text(b)) => a == b,
            (RecordedBody::Base64(a), RecordedBody::Base64(b)) => a == b,
            _ => false,
        }
    }
}

impl RecordedBody {
    fn new(bytes: &[u8]) -> Self {
        let Ok(text) = std::str::from_utf8(bytes) else {
            return RecordedBody::Base64(Base64(bytes.to_vec()));
        };
        // Only a document with no whitespace around it: a raw value drops that, and the
        // replay must be byte for byte.
        if let Ok(raw) = serde_json::from_str::<&RawValue>(text)
            && raw.get().len() == text.len()
        {
            return RecordedBody::Json(raw.to_owned());
        }
        if escaped_len(text) <= base64_len(text.len()) {
            RecordedBody::Text(text.to_owned())
        } else {
            RecordedBody::Base64(Base64(bytes.to_vec()))
        }
    }

    fn into_bytes(self) -> Vec<u8> {
        match self {
            RecordedBody::Json(raw) => Box::<str>::from(raw).into_string().into_bytes(),
            RecordedBody::Text(text) => text.into_bytes(),
            RecordedBody::Base64(Base64(bytes)) => bytes,
        }
    }
}

/// A header value as recorded: a string where it is UTF-8 and escaping it costs no more
/// than base64, else its bytes in base64 (values may hold any byte but controls).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
enum HeaderBytes {
    Text(String),
    Bytes { base64: Base64 },
}

impl HeaderBytes {
    fn new(value: &HeaderValue) -> Self {
        match std::str::from_utf8(value.as_bytes()) {
            Ok(text) if escaped_len(text) <= base64_len(text.len()) => {
                HeaderBytes::Text(text.to_owned())
            }
            _ => HeaderBytes::Bytes {
                base64: Base64(value.as_bytes().to_vec()),
            },
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            HeaderBytes::Text(text) => text.as_bytes(),
            HeaderBytes::Bytes { base64 } => &base64.0,
        }
    }
}

/// Bytes recorded as a base64 string (standard alphabet, padded).
#[derive(Debug, PartialEq)]
struct Base64(Vec<u8>);

impl Serialize for Base64 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&BASE64.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Base64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        BASE64
            .decode(text)
            .map(Base64)
            .map_err(serde::de::Error::custom)
    }
}

/// The length of `text` as a JSON string's contents, at most (serde_json escapes `"`,
/// `\` and control characters, and nothing else).
fn escaped_len(text: &str) -> usize {
    text.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..0x20 => 6,
            _ => 1,
        })
        .sum()
}

/// The length of `n` bytes in padded base64.
fn base64_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// Reads a record of schema version 1: bodies as text or hex, header values as text.
fn upgrade(name: &str, from: u32, value: serde_json::Value) -> Result<Recorded, IdemError> {
    #[derive(Deserialize)]
    struct V1 {
        status: u16,
        headers: Vec<(String, String)>,
        body: V1Body,
    }
    #[derive(Deserialize)]
    enum V1Body {
        Text(String),
        Hex(String),
    }
    let codec = |message: String| IdemError::Codec {
        name: name.to_owned(),
        message,
    };
    if from != 1 {
        return Err(codec(format!(
            "a response recorded under schema version {from} cannot be read by this build \
             (version {RECORD_VERSION}); deploy the newer build everywhere, or wait for the \
             record to expire"
        )));
    }
    let v1: V1 = serde_json::from_value(value)
        .map_err(|e| codec(format!("cannot read a version-1 recorded response: {e}")))?;
    let body = match v1.body {
        V1Body::Text(text) => text.into_bytes(),
        V1Body::Hex(hex) => unhex(&hex),
    };
    Ok(Recorded {
        status: v1.status,
        headers: v1
            .headers
            .into_iter()
            .map(|(name, value)| (name, HeaderBytes::Text(value)))
            .collect(),
        body: RecordedBody::new(&body),
    })
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// A body's outcome that is not recorded.
#[derive(Serialize, Deserialize)]
enum NotRecorded {
    /// A response the status policy does not record: passed on, the key released.
    #[serde(skip)]
    Released(Response),
    /// The response is over the cap, or its body failed mid-way: it ran, so the key goes
    /// to UNKNOWN.
    Unrecordable,
    #[serde(skip)]
    Idem(IdemError),
}

impl From<IdemError> for NotRecorded {
    fn from(e: IdemError) -> Self {
        NotRecorded::Idem(e)
    }
}

fn disposition(e: &NotRecorded) -> Disposition {
    match e {
        NotRecorded::Unrecordable => Disposition::Unknown,
        NotRecorded::Released(_) | NotRecorded::Idem(_) => Disposition::Release,
    }
}

async fn handle<S>(cfg: Arc<Config>, mut inner: S, req: Request<Body>) -> Response
where
    S: Service<Request<Body>, Error = Infallible> + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    if !cfg.methods.contains(req.method()) {
        let Ok(res) = inner.call(req).await;
        return res.into_response();
    }
    let key = match IdempotencyKey::from_headers(req.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !cfg.require_key => {
            let Ok(res) = inner.call(req).await;
            return res.into_response();
        }
        Ok(None) => return cfg.answer(KeyRejection::Missing.into()),
        Err(e) => return cfg.answer(e.into()),
    };
    let Some(principal) = req.extensions().get::<Principal>().cloned() else {
        tracing::error!(
            "IdempotencyLayer: no Principal in the request's extensions; is the auth \
             layer outside it?"
        );
        return cfg.answer(Problem::no_principal());
    };
    let (parts, body) = req.into_parts();
    let max = cfg.max_request_bytes.min(cfg.budget.bytes());
    let buffered = match read_body(&parts.headers, body, max, cfg.body_timeout, &cfg.budget).await {
        Ok(buffered) => buffered,
        Err(problem) => return cfg.answer(problem),
    };
    // The URI as the client sent it: inside a nested router, `parts.uri` has lost the
    // nest's prefix.
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    // Shared by the record's upgrade, the body's timing and the 409's hint.
    let name: Arc<str> = operation_name(&cfg, &parts.method, &parts.extensions, uri.path()).into();
    let op = cfg
        .idem
        .operation(&name, &key)
        .scope(&principal)
        .retain(cfg.retain)
        .lease(cfg.lease)
        .in_flight(cfg.in_flight)
        .fingerprint_part("method", parts.method.as_str())
        .fingerprint_part("path", uri.path())
        .fingerprint_part(
            "query",
            &canonical_form(uri.query().unwrap_or("").as_bytes()),
        )
        .fingerprint_part("content_type", &content_types(&parts.headers));
    let kind = body_kind(&parts.headers);
    let json = match kind {
        BodyKind::Json => Json::parse(&buffered.bytes),
        BodyKind::Form | BodyKind::Bytes => None,
    };
    if let Some(member) = json.as_ref().and_then(Json::repeated_member) {
        return cfg.answer(Problem::ambiguous_body(member));
    }
    let op = match (json, kind) {
        (Some(json), _) => op.fingerprint_part("body_json", &json),
        (None, BodyKind::Form) => {
            op.fingerprint_part("body_form", &canonical_form(&buffered.bytes))
        }
        (None, _) => op.fingerprint_part("body_sha256", &Sha256::digest(&buffered.bytes)[..]),
    };
    let (route, timed) = (name.clone(), name.clone());
    let op = op
        .version(RECORD_VERSION)
        .upgrade(move |from: u32, value: serde_json::Value| upgrade(&name, from, value))
        .classify(disposition);
    let Buffered { bytes, permit } = buffered;
    let req = Request::from_parts(parts, Body::from(bytes));
    let limits = cfg.clone();
    // The response as the routes made it, for the request that ran them: the record
    // keeps only the recorded headers, the first answer keeps them all.
    let first = Arc::new(std::sync::Mutex::new(None));
    let made = first.clone();
    let call = async move {
        let body = || async move {
            // Only a fresh claim gets here: replays and in-flight answers take no token.
            if let Some(limiter) = &limits.claims
                && let Err(wait) = limiter.take(principal.as_str())
            {
                let refused = limits.answer(Problem::too_many_claims(wait));
                return Err(NotRecorded::Released(refused));
            }
            let started = std::time::Instant::now();
            let Ok(res) = inner.call(req).await;
            limits.durations.observe(&timed, started.elapsed());
            let (recorded, res) = record(&limits, res.into_response()).await?;
            *made.lock().unwrap_or_else(|p| p.into_inner()) = Some(res);
            Ok(recorded)
        };
        let out = observe(op.run(body)).await;
        // The request's share of the buffer budget is held until it is done.
        drop(permit);
        out
    };
    let (out, info) = if cfg.spawn {
        run_spawned(call).await
    } else {
        call.await
    };
    match out {
        Ok(recorded) => {
            let made = first.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(res) = made {
                return res;
            }
            let mut res = recorded.into_response();
            if info.replayed() {
                res.headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            }
            res
        }
        Err(NotRecorded::Released(res)) => res,
        Err(NotRecorded::Unrecordable) => cfg.answer(Problem::outcome_unknown()),
        Err(NotRecorded::Idem(e)) => {
            let mut problem = Problem::from(&e);
            log_server_side(&e, &problem);
            if let Some(remaining) = in_flight_for(&e) {
                problem = problem.retry_after(cfg.durations.hint(&route, remaining));
            }
            cfg.answer(problem)
        }
    }
}

/// The operation's name: the layer's own if it has one, else the method and the route
/// (`POST /v1/payments`), so each route's keys are its own. The route is axum's
/// `MatchedPath` (a template, so one name per route whatever its parameters), else the
/// request's path; one over idem's cap on names is named by its SHA-256 instead.
fn operation_name(
    cfg: &Config,
    method: &Method,
    extensions: &http::Extensions,
    path: &str,
) -> String {
    if let Some(name) = &cfg.name {
        return name.clone();
    }
    let route = extensions
        .get::<MatchedPath>()
        .map_or(path, MatchedPath::as_str);
    let name = format!("{method} {route}");
    if name.len() <= MAX_KEY_BYTES {
        return name;
    }
    let digest = Sha256::digest(route.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{method} sha256:{hex}")
}

/// Buffers a response the policy records, returning its record and the response as it
/// was made (its body buffered); passes on one it does not record.
async fn record(cfg: &Config, res: Response) -> Result<(Recorded, Response), NotRecorded> {
    if !cfg.records(res.status()) {
        return Err(NotRecorded::Released(res));
    }
    let (parts, body) = res.into_parts();
    let mut headers = Vec::new();
    let mut size = 0usize;
    for name in &cfg.recorded_headers {
        for value in parts.headers.get_all(name) {
            size = size.saturating_add(name.as_str().len() + value.len() + HEADER_OVERHEAD);
            headers.push((name.as_str().to_owned(), HeaderBytes::new(value)));
        }
    }
    let unrecordable = |why: &str| {
        tracing::error!(
            max = cfg.max_response_bytes,
            "IdempotencyLayer: {why}; the request ran, so its key is now UNKNOWN (raise \
             `max_response_bytes`, with the store's outcome cap, to record such responses)"
        );
        NotRecorded::Unrecordable
    };
    let Some(body_max) = cfg.max_response_bytes.checked_sub(size) else {
        return Err(unrecordable(
            "a response's recorded headers are over the cap",
        ));
    };
    let bytes = match Limited::new(body, body_max).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Err(unrecordable("a response is over the cap"));
        }
        Err(_) => return Err(unrecordable("a response body failed mid-way")),
    };
    let recorded = Recorded {
        status: parts.status.as_u16(),
        headers,
        body: RecordedBody::new(&bytes),
    };
    Ok((recorded, Response::from_parts(parts, Body::from(bytes))))
}

impl IntoResponse for Recorded {
    fn into_response(self) -> Response {
        let mut res = Response::new(Body::from(self.body.into_bytes()));
        *res.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(value.as_bytes()),
            ) {
                res.headers_mut().append(name, value);
            }
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records `res` as the layer does, to the bytes the store would get.
    fn stored(recorded: &Recorded) -> Vec<u8> {
        serde_json::to_vec(recorded).expect("a record serializes")
    }

    fn response(headers: &[(&str, &[u8])], body: Vec<u8>) -> Response {
        let mut res = Response::new(Body::from(body));
        for (name, value) in headers {
            res.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        res
    }

    fn config(cap: usize, headers: &[&str]) -> Config {
        let idem = crate::Idem::builder().max_outcome_bytes(cap).memory();
        let mut layer = IdempotencyLayer::new(idem);
        for name in headers {
            layer = layer.record_header(HeaderName::from_bytes(name.as_bytes()).unwrap());
        }
        layer.cfg
    }

    /// The worst cases for the record's size: every response at the layer's limit, in
    /// the encodings that grow most, fits the store's cap.
    #[tokio::test]
    async fn every_response_within_the_limit_fits_the_cap() {
        for cap in [ENVELOPE_BYTES, 100, 1000, 4097, 64 * 1024] {
            let cfg = config(cap, &["a", "b"]);
            let limit = cfg.max_response_bytes;
            assert_eq!(limit, largest_recordable(cap));
            let header = |value: &'static [u8]| ("a", value);
            let bodies = |n: usize| -> Vec<Vec<u8>> {
                vec![
                    vec![0xff; n],
                    vec![b'"'; n],
                    vec![0x01; n],
                    (0..n).map(|i| (i * 7 % 256) as u8).collect(),
                ]
            };
            let header_sets: Vec<Vec<(&str, &[u8])>> = vec![
                vec![],
                vec![header(b"\xff")],
                vec![header(b"\""), ("b", b"\\\\\\")],
                vec![header(b"\xe9\xe9\xe9\xe9"); 3],
            ];
            for headers in &header_sets {
                let size: usize = headers
                    .iter()
                    .map(|(n, v)| n.len() + v.len() + HEADER_OVERHEAD)
                    .sum();
                let Some(room) = limit.checked_sub(size) else {
                    continue;
                };
                for body in bodies(room) {
                    let res = response(headers, body.clone());
                    let Ok((recorded, _)) = record(&cfg, res).await else {
                        panic!("cap {cap}: a response of {limit} bytes was refused");
                    };
                    let bytes = stored(&recorded);
                    assert!(
                        bytes.len() <= cap,
                        "cap {cap}: a response of {limit} bytes records in {}",
                        bytes.len()
                    );
                    let back: Recorded = serde_json::from_slice(&bytes).unwrap();
                    assert_eq!(back, recorded);
                    assert_eq!(back.body.into_bytes(), body);
                }
            }
        }
    }

    #[tokio::test]
    async fn a_response_over_the_limit_is_unrecordable() {
        let cfg = config(1000, &[]);
        let res = response(&[], vec![b'x'; cfg.max_response_bytes + 1]);
        assert!(matches!(
            record(&cfg, res).await,
            Err(NotRecorded::Unrecordable)
        ));
    }

    #[test]
    fn bodies_record_compactly_and_exactly() {
        let json = br#"{"b": [1, 2.50, "\u00e9"], "a":null}"#;
        let body = RecordedBody::new(json);
        assert!(matches!(body, RecordedBody::Json(_)));
        let record = serde_json::to_string(&body).unwrap();
        assert_eq!(record.len(), json.len() + r#"{"json":}"#.len());
        let back: RecordedBody = serde_json::from_str(&record).unwrap();
        assert_eq!(back.into_bytes(), json);
        // Whitespace around a document is kept, as text.
        assert!(matches!(RecordedBody::new(b"[1]\n"), RecordedBody::Text(_)));
        assert!(matches!(RecordedBody::new(b"done"), RecordedBody::Text(_)));
        assert!(matches!(
            RecordedBody::new(&[b'"'; 30]),
            RecordedBody::Base64(_)
        ));
        assert!(matches!(
            RecordedBody::new(b"\xff\x00"),
            RecordedBody::Base64(_)
        ));
    }

    #[test]
    fn escaped_len_matches_serde_json() {
        let all: String = (0u8..0x80).map(char::from).chain("é€".chars()).collect();
        for text in [all.as_str(), "", "plain", "\"q\"\\"] {
            let quoted = serde_json::to_string(text).unwrap();
            assert_eq!(escaped_len(text), quoted.len() - 2, "{text:?}");
        }
    }

    #[test]
    fn version_one_records_are_read() {
        let v1 = serde_json::json!({
            "status": 201,
            "headers": [["content-type", "application/json"]],
            "body": {"Text": "{\"id\":7}"},
        });
        let r = upgrade("http", 1, v1).unwrap();
        assert_eq!(r.status, 201);
        assert_eq!(
            r.headers,
            [(
                "content-type".to_owned(),
                HeaderBytes::Text("application/json".into())
            )]
        );
        assert_eq!(r.body.into_bytes(), b"{\"id\":7}");
        let hex = serde_json::json!({"status": 200, "headers": [], "body": {"Hex": "ff00"}});
        assert_eq!(
            upgrade("http", 1, hex).unwrap().body.into_bytes(),
            [0xff, 0x00]
        );
        assert!(matches!(
            upgrade("http", 3, serde_json::Value::Null),
            Err(IdemError::Codec { .. })
        ));
    }

    #[test]
    #[should_panic(expected = "IdemBuilder::max_outcome_bytes(87448)")]
    fn a_limit_the_cap_may_not_hold_is_refused_at_construction() {
        let _ = IdempotencyLayer::new(crate::Idem::memory()).max_response_bytes(64 * 1024);
    }
}
