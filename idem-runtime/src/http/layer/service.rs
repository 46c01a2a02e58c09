//! [`IdempotencyService`]: the service [`IdempotencyLayer`] makes, and a request's way
//! through it (key, principal, body, fingerprint, claim, answer).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::BoxError;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, OriginalUri};
use axum::response::{IntoResponse, Response};
use http::header::HeaderValue;
use http::{Method, Request};
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use super::codec::{RECORD_VERSION, upgrade};
use super::record::{NotRecorded, disposition, record};
use super::{Config, IdempotencyLayer, status};
use crate::context::observe;
use crate::error::IdemError;
use crate::http::canonical::{BodyKind, Json, body_kind, canonical_form, content_types};
use crate::http::key::{IDEMPOTENT_REPLAYED, IdempotencyKey, ReplayHeaderSet};
use crate::http::limits::{Buffered, read_body};
use crate::http::principal::Principal;
use crate::http::problem::{Problem, in_flight_for, log_server_side};
use crate::http::rejection::KeyRejection;
use crate::http::spawned::run_spawned;
use crate::op::MAX_KEY_BYTES;

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
        req.extensions_mut().insert(ReplayHeaderSet);
        Box::pin(async move { Ok(handle(cfg, inner, req).await) })
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
    let op = match &cfg.claims {
        Some(limiter) => op.claim_limiter(limiter.clone()),
        None => op,
    };
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
    // What an accepting route's `202` names: the same for every duplicate.
    let target = cfg.accept.is_some().then(|| status::Target {
        idem: cfg.idem.clone(),
        principal: principal.clone(),
        id: op.id().clone(),
        retain: cfg.retain,
        recorded: status::Recording::Response,
    });
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
    let (out, info) = match &cfg.accept {
        Some(accept) => match accept.run(call, || target.clone()).await {
            Ok(ran) => ran,
            Err(accepted) => return accepted,
        },
        None if cfg.spawn => run_spawned(call).await,
        None => call.await,
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
        // A duplicate of an operation still running, on an accepting route: where
        // to ask for it.
        Err(NotRecorded::Idem(IdemError::InFlight { .. }))
            if let (Some(accept), Some(target)) = (&cfg.accept, &target)
                && let Some(accepted) = accept.accepted(target).await =>
        {
            accepted
        }
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
