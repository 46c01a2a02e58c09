//! `IdempotencyLayer`: the `Idempotency-Key` behaviour for a whole router.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use super::handler::run_spawned;
use super::key::{IDEMPOTENT_REPLAYED, IdempotencyKey, KeyRejection};
use super::principal::Principal;
use super::problem::Problem;
use crate::context::observe;
use crate::error::IdemError;
use crate::idem::Idem;
use crate::op::{Disposition, InFlight};

/// Makes the requests below it idempotent by their `Idempotency-Key` header, without
/// touching handlers.
///
/// For each request whose method is covered (POST and PATCH by default; others pass
/// through untouched):
/// - the key comes from the header (missing or invalid: 400) and the scope from the
///   [`Principal`] the application's auth layer put in the request's extensions (none:
///   500, the request does not run; there is no global scope);
/// - the request is fingerprinted: method, path, query and body (buffered, at most
///   [`max_request_bytes`](Self::max_request_bytes), else 413), so the key reused with
///   another request is a 422;
/// - the first request runs the routes below; the response's status, the
///   [recorded headers](Self::record_header) and its body are recorded and replayed to
///   every retry with `Idempotent-Replayed: true` (the first answer, too, carries only
///   the recorded headers, so it and its replays are alike). Responses that say "try again"
///   (5xx, 408, 425, 429 by default, see [`record_status`](Self::record_status)) are
///   passed on but not recorded: the key is released and a retry runs again;
/// - a retry while the first request runs gets 409 with `Retry-After` at once (the
///   draft's behaviour; see [`in_flight`](Self::in_flight));
/// - the request runs in its own task, so it finishes and records its outcome even if
///   the client disconnects, and the client's retry replays it
///   ([`run_to_completion`](Self::run_to_completion)).
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
///     .route_layer(IdempotencyLayer::new(idem).name("orders").retain(Duration::from_secs(86400)));
/// // .layer(your_auth_layer) -- it must set an `idem_runtime::http::Principal`
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    cfg: Config,
}

#[derive(Clone, Debug)]
struct Config {
    idem: Idem,
    name: String,
    retain: Duration,
    lease: Duration,
    in_flight: InFlight,
    methods: Vec<Method>,
    require_key: bool,
    max_request_bytes: usize,
    max_response_bytes: usize,
    recorded_headers: Vec<HeaderName>,
    record_status: fn(StatusCode) -> bool,
    spawn: bool,
}

fn default_record_status(status: StatusCode) -> bool {
    !(status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_EARLY
        || status == StatusCode::TOO_MANY_REQUESTS)
}

impl IdempotencyLayer {
    /// The layer over `idem`'s store, with the defaults: operation name `http`, retain
    /// 24 hours, lease 60 seconds, in-flight retries rejected at once, POST and PATCH
    /// covered, the key required, request bodies up to 1 MiB, responses up to the
    /// store's outcome cap, headers `content-type`, `location`, `content-language` and
    /// `etag` recorded, requests run to completion.
    pub fn new(idem: Idem) -> Self {
        let max_response_bytes = idem.max_outcome_bytes();
        IdempotencyLayer {
            cfg: Config {
                idem,
                name: "http".into(),
                retain: Duration::from_secs(24 * 3600),
                lease: Duration::from_secs(60),
                in_flight: InFlight::Reject,
                methods: vec![Method::POST, Method::PATCH],
                require_key: true,
                max_request_bytes: 1 << 20,
                max_response_bytes,
                recorded_headers: vec![
                    header::CONTENT_TYPE,
                    header::LOCATION,
                    header::CONTENT_LANGUAGE,
                    header::ETAG,
                ],
                record_status: default_record_status,
                spawn: true,
            },
        }
    }

    /// The operation name the requests are recorded under (default `http`). Layers with
    /// different names keep separate keys; under one name a key reused on another
    /// route is a 422.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.cfg.name = name.into();
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

    /// The largest request body buffered for the fingerprint (default 1 MiB); larger
    /// is a 413 and the request does not run.
    pub fn max_request_bytes(mut self, max: usize) -> Self {
        self.cfg.max_request_bytes = max;
        self
    }

    /// The largest response body recorded (default: the store's outcome cap). A larger
    /// response cannot be replayed: the request ran, so its key moves to UNKNOWN for
    /// reconciliation and the client gets a 500.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.cfg.max_response_bytes = max;
        self
    }

    /// Records and replays this response header too.
    pub fn record_header(mut self, name: HeaderName) -> Self {
        if !self.cfg.recorded_headers.contains(&name) {
            self.cfg.recorded_headers.push(name);
        }
        self
    }

    /// Which response statuses are recorded; the others release the key, so a retry
    /// runs again. Default: all but 5xx, 408, 425 and 429.
    pub fn record_status(mut self, record: fn(StatusCode) -> bool) -> Self {
        self.cfg.record_status = record;
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

impl<S> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = self.cfg.clone();
        Box::pin(async move { Ok(handle(cfg, inner, req).await) })
    }
}

/// A response as recorded: replayed with the same status, headers and body.
#[derive(Serialize, Deserialize)]
struct Recorded {
    status: u16,
    headers: Vec<(String, String)>,
    body: RecordedBody,
}

#[derive(Serialize, Deserialize)]
enum RecordedBody {
    /// UTF-8 bodies as they are (JSON stays readable in the store and compact).
    Text(String),
    Hex(String),
}

/// A body's outcome that is not recorded.
#[derive(Serialize, Deserialize)]
enum NotRecorded {
    /// A response the status policy does not record: passed on, the key released.
    #[serde(skip)]
    Released(Response),
    /// The response body is over the cap: it ran, so the key goes to UNKNOWN.
    TooLarge,
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
        NotRecorded::TooLarge => Disposition::Unknown,
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
        Ok(None) => return Problem::from(KeyRejection::Missing).into_response(),
        Err(e) => return Problem::from(e).into_response(),
    };
    let Some(principal) = req.extensions().get::<Principal>().cloned() else {
        tracing::error!(
            "IdempotencyLayer: no Principal in the request's extensions; is the auth \
             layer outside it?"
        );
        return Problem::no_principal().into_response();
    };
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, cfg.max_request_bytes).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Problem::body_too_large(cfg.max_request_bytes).into_response();
        }
        Err(_) => return Problem::body_unreadable().into_response(),
    };
    let op = cfg
        .idem
        .operation(&cfg.name, &key)
        .scope(&principal)
        .retain(cfg.retain)
        .lease(cfg.lease)
        .in_flight(cfg.in_flight)
        .fingerprint_part("method", parts.method.as_str())
        .fingerprint_part("path", parts.uri.path())
        .fingerprint_part("query", &parts.uri.query())
        .fingerprint_part("body_sha256", &Sha256::digest(&bytes)[..])
        .classify(disposition);
    let req = Request::from_parts(parts, Body::from(bytes));
    let limits = cfg.clone();
    let call = async move {
        let body = || async move {
            let Ok(res) = inner.call(req).await;
            record(&limits, res.into_response()).await
        };
        observe(op.run(body)).await
    };
    let (out, info) = if cfg.spawn {
        run_spawned(call).await
    } else {
        call.await
    };
    match out {
        Ok(recorded) => {
            let mut res = recorded.into_response();
            if info.replayed() {
                res.headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            }
            res
        }
        Err(NotRecorded::Released(res)) => res,
        Err(NotRecorded::TooLarge) => Problem::outcome_unknown().into_response(),
        Err(NotRecorded::Idem(e)) => e.into_response(),
    }
}

/// Buffers a response the policy records; passes on one it does not.
async fn record(cfg: &Config, res: Response) -> Result<Recorded, NotRecorded> {
    if !(cfg.record_status)(res.status()) {
        return Err(NotRecorded::Released(res));
    }
    let (parts, body) = res.into_parts();
    let Ok(collected) = Limited::new(body, cfg.max_response_bytes).collect().await else {
        tracing::error!(
            max = cfg.max_response_bytes,
            "IdempotencyLayer: a response body is over the cap or failed; the request ran, \
             so its key is now UNKNOWN"
        );
        return Err(NotRecorded::TooLarge);
    };
    let bytes = collected.to_bytes();
    let headers = cfg
        .recorded_headers
        .iter()
        .flat_map(|name| {
            parts.headers.get_all(name).iter().filter_map(move |v| {
                v.to_str()
                    .ok()
                    .map(|v| (name.as_str().to_owned(), v.to_owned()))
            })
        })
        .collect();
    let body = match String::from_utf8(bytes.to_vec()) {
        Ok(text) => RecordedBody::Text(text),
        Err(e) => RecordedBody::Hex(hex(e.as_bytes())),
    };
    Ok(Recorded {
        status: parts.status.as_u16(),
        headers,
        body,
    })
}

impl IntoResponse for Recorded {
    fn into_response(self) -> Response {
        let body = match self.body {
            RecordedBody::Text(text) => text.into_bytes(),
            RecordedBody::Hex(hex) => unhex(&hex),
        };
        let mut res = Response::new(Body::from(body));
        *res.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                res.headers_mut().append(name, value);
            }
        }
        res
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}
