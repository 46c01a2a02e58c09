//! The tower layer.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tower::{Layer, Service};

use super::{Config, config_methods};

/// A tower layer that sends the running operation's downstream key as `Idempotency-Key`
/// on the requests of an HTTP client: the same key on every retry, resume and takeover
/// of the operation, so the service called deduplicates what a re-run sends again.
///
/// Any `Service<http::Request<B>>` client takes it: hyper-util's client, a tonic
/// channel, a tower stack. Put it above the stack's retry layer (the retries resend
/// the header it set) and call the client from the body's own task. The
/// [module](super) says which label keys which call, when to label by hand, and what
/// happens outside a body.
///
/// The key is computed in `call`, on the task that calls the service.
///
/// ```
/// use idem_runtime::client::PropagateKeyLayer;
/// use tower::{ServiceBuilder, service_fn};
///
/// let client = ServiceBuilder::new()
///     .layer(PropagateKeyLayer::new().key_per_request(true))
///     .service(service_fn(|req: http::Request<String>| async move {
///         Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
///     }));
/// # let _ = client;
/// ```
#[derive(Clone, Debug, Default)]
pub struct PropagateKeyLayer {
    cfg: Arc<Config>,
}

impl PropagateKeyLayer {
    /// The layer with its defaults: header `Idempotency-Key`, POST and PATCH keyed,
    /// requests outside a body untouched.
    pub fn new() -> Self {
        Self::default()
    }

    config_methods!();
}

impl<S> Layer<S> for PropagateKeyLayer {
    type Service = PropagateKeyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PropagateKeyService {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// The service [`PropagateKeyLayer`] makes: sets the key on each request, then calls
/// the client it wraps.
#[derive(Clone, Debug)]
pub struct PropagateKeyService<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S> PropagateKeyService<S> {
    /// The client this wraps.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the client.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<Request<B>> for PropagateKeyService<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let key = self.cfg.key_for(
            req.method(),
            req.uri().path(),
            req.headers(),
            req.extensions(),
        );
        if let Some(key) = key {
            req.headers_mut().insert(self.cfg.header.clone(), key);
        }
        self.inner.call(req)
    }
}
