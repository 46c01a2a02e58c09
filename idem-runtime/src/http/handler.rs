//! For routes whose handlers carry `#[idempotent]`: the replay header, and handlers
//! run to completion when the client goes away.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Request};
use tower::{Layer, Service};

use super::estimate::{Durations, Route};
use super::key::{IDEMPOTENT_REPLAYED, ReplayHeaderSet};
use super::layer::status::{Accept, Recording, Target};
use super::principal::Principal;
use super::problem::InFlightFor;
use super::spawned::run_spawned;
use crate::context::{self, observe};

/// A tower layer for routes whose handlers are `#[idempotent]` functions.
///
/// - Sets `Idempotent-Replayed: true` on a response whose idempotent call was
///   replayed (a recorded success or a recorded error alike), as [`observe`] reports.
///   With several idempotent calls in one handler, the last one decides.
/// - Runs the handler in its own task ([`run_to_completion`](Self::run_to_completion),
///   on by default): axum drops a handler's future when the client disconnects, which
///   would stop the body mid-effect and hold its claim until the lease lapses; spawned,
///   the body finishes and records its outcome, so the client's retry replays it.
/// - Answers a retry that found its key in flight (409) with a `Retry-After` of about
///   how long the route's requests take: a running average of the handlers that ran,
///   at least 1 s and at most what is left of the running request's lease (1 s until
///   one has finished). The route is the method and axum's `MatchedPath`.
///
/// Add it with `.layer` on the router, inside the auth layer (see
/// [where the auth layer goes](super#where-the-auth-layer-goes)). A route without it
/// compiles and runs, but nothing there sets the replay header: the first request whose
/// [`IdempotencyKey`](super::IdempotencyKey) is extracted on such a route logs a
/// warning, once per process, that says to add `.layer(IdempotentHandlerLayer::new())`.
///
/// ```
/// use axum::{Router, routing::post};
/// use idem_runtime::http::IdempotentHandlerLayer;
/// # async fn create() {}
/// let app: Router = Router::new()
///     .route("/payments", post(create))
///     .layer(IdempotentHandlerLayer::new());
/// ```
#[derive(Clone, Debug)]
pub struct IdempotentHandlerLayer {
    spawn: bool,
    durations: Arc<Durations>,
    accept: Option<Accept>,
}

impl Default for IdempotentHandlerLayer {
    fn default() -> Self {
        IdempotentHandlerLayer {
            spawn: true,
            durations: Arc::default(),
            accept: None,
        }
    }
}

impl IdempotentHandlerLayer {
    /// The layer, with handlers run to completion.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a handler runs on when the client disconnects (default `true`).
    pub fn run_to_completion(mut self, spawn: bool) -> Self {
        self.spawn = spawn;
        self
    }

    /// Answers a request whose handler has not finished within `after` with `202
    /// Accepted` and lets the handler run on, as
    /// [`IdempotencyLayer::accept_after`](super::IdempotencyLayer::accept_after) does:
    /// the operation is the one the handler's first idempotent call claimed, its
    /// `Location` names the [`status_routes`](super::status_routes) resource (at
    /// [`status_path`](Self::status_path), `/operations` by default), and a duplicate
    /// answered "in flight" gets the same `202`. The request needs a
    /// [`Principal`](super::Principal) (the status URL is the caller's alone) and the
    /// handler's `Idem` a [`status_secret`](crate::IdemBuilder::status_secret) (or a
    /// `hash_keys` secret); without them, or past
    /// [`max_detached`](Self::max_detached) handlers at once, the request waits for its
    /// handler as usual.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{Router, routing::post};
    /// use idem_runtime::http::IdempotentHandlerLayer;
    /// # async fn payout() {}
    /// let app: Router = Router::new()
    ///     .route("/payouts", post(payout))
    ///     .layer(IdempotentHandlerLayer::new().accept_after(Duration::from_secs(2)));
    /// ```
    pub fn accept_after(mut self, after: Duration) -> Self {
        self.accept = Some(Accept::new(after, self.accept.take()));
        self
    }

    /// Where the status resource is nested (default `/operations`). Call after
    /// [`accept_after`](Self::accept_after).
    ///
    /// # Panics
    ///
    /// Before `accept_after`.
    pub fn status_path(mut self, path: &str) -> Self {
        let accept = self.accept.as_mut().expect(
            "IdempotentHandlerLayer::status_path: call `accept_after` first; without it no \
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
        let accept = self.accept.as_mut().expect(
            "IdempotentHandlerLayer::max_detached: call `accept_after` first; without it no \
             handler runs detached",
        );
        accept.set_max(max);
        self
    }

    /// Waits, up to `within`, for the handlers this layer (and its clones) detached to
    /// end; `true` if none is left (see
    /// [`IdempotencyLayer::drain`](super::IdempotencyLayer::drain)).
    pub async fn drain(&self, within: Duration) -> bool {
        match &self.accept {
            Some(accept) => accept.drain(within).await,
            None => true,
        }
    }
}

impl<S> Layer<S> for IdempotentHandlerLayer {
    type Service = IdempotentHandler<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentHandler {
            inner,
            spawn: self.spawn,
            durations: self.durations.clone(),
            accept: self.accept.clone(),
        }
    }
}

/// The service [`IdempotentHandlerLayer`] makes.
#[derive(Clone, Debug)]
pub struct IdempotentHandler<S> {
    inner: S,
    spawn: bool,
    durations: Arc<Durations>,
    accept: Option<Accept>,
}

impl<S, B> Service<Request<B>> for IdempotentHandler<S>
where
    S: Service<Request<B>, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        req.extensions_mut().insert(ReplayHeaderSet);
        // The clone that was polled ready serves this request (tower's usual swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let spawn = self.spawn;
        let durations = self.durations.clone();
        // The route's parts, formatted only for a handler that ran or a 409.
        let route = Route::of(req.method(), req.extensions());
        let accept = self.accept.clone();
        // Whose request it is, and (once its first idempotent call claims or meets it)
        // which operation: what an accepting route's `202` names.
        let principal = (accept.is_some())
            .then(|| req.extensions().get::<Principal>().cloned())
            .flatten();
        let watched = context::Watched::default();
        let target = {
            let watched = watched.clone();
            move || {
                let watch = watched.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
                Some(Target {
                    idem: watch.idem,
                    principal: principal?,
                    id: (*watch.id).clone(),
                    retain: watch.retain,
                    recorded: Recording::Value,
                })
            }
        };
        Box::pin(async move {
            let call = async move {
                let started = std::time::Instant::now();
                let (res, info) = observe(inner.call(req)).await;
                let Ok(res) = res;
                (res.into_response(), info, started.elapsed())
            };
            let (mut res, info, took) = match &accept {
                Some(accept) => {
                    let call = context::watch(watched, call);
                    match accept.run(call, target.clone()).await {
                        Ok(ran) => ran,
                        Err(accepted) => return Ok(accepted),
                    }
                }
                None if spawn => run_spawned(call).await,
                None => call.await,
            };
            // A duplicate of an operation still running, on an accepting route.
            if let Some(accept) = &accept
                && res.extensions().get::<InFlightFor>().is_some()
                && let Some(target) = target()
                && let Some(accepted) = accept.accepted(&target).await
            {
                return Ok(accepted);
            }
            if let Some(route) = route {
                if info.epoch().is_some() && !info.replayed() {
                    durations.observe(&route.name(), took);
                }
                if res.extensions().get::<InFlightFor>().is_some() {
                    res = durations.hint_response(&route.name(), res).await;
                }
            }
            if info.replayed() {
                res.headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
            }
            Ok(res)
        })
    }
}
