//! The reqwest middleware.

use std::sync::Arc;

use http::{Extensions, HeaderName, HeaderValue, Method};
use reqwest::Url;
use reqwest_middleware::{Middleware, Next};

use super::{Config, config_methods};

/// The running operation's downstream key as `Idempotency-Key` on the requests of a
/// reqwest client, as a `reqwest_middleware::Middleware`: what [`PropagateKeyLayer`]
/// does for tower clients, with the same labels (the [module](super) has the table),
/// and the same options.
///
/// **Order: before the retry middleware.** Middleware runs in the order it is attached,
/// so attach `PropagateKey` first and `reqwest-retry`'s `RetryTransientMiddleware`
/// after it: the key is set once, on the request the retry middleware then clones for
/// each attempt, and every retry of one call carries one key. Attached the other way
/// round, it still sends one key per call: the key it chose for the call's first
/// attempt is kept in the call's extensions (which the retry middleware hands to every
/// attempt) and sent again on the next ones, so no retry counts as a call of its own.
///
/// A [`KeyLabel`](super::KeyLabel) goes in with `RequestBuilder::with_extension`.
/// Extensions handed to `ClientWithMiddleware::execute_with_extensions` belong to one
/// call: a second call with the same method and URL on the same extensions would be
/// taken for a retry of the first, and carry its key.
///
/// ```no_run
/// use idem_runtime::client::{KeyLabel, PropagateKey};
/// use idem_runtime::{Idem, IdemError};
/// use reqwest_retry::{RetryTransientMiddleware, policies::ExponentialBackoff};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let retry = ExponentialBackoff::builder().build_with_max_retries(3);
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(PropagateKey::new()) // first: one key per call ...
///     .with(RetryTransientMiddleware::new_with_policy(retry)) // ... on every retry
///     .build();
///
/// let idem = Idem::memory();
/// let status = idem
///     .operation("refund", "order-1")
///     .retain(std::time::Duration::from_secs(86_400))
///     .fingerprint_none()
///     .run(|| async {
///         let answer = client
///             .post("http://127.0.0.1:8080/refunds")
///             .with_extension(KeyLabel("refund")) // or keyed `POST /refunds#0`
///             .body("{\"cents\":100}")
///             .send()
///             .await?;
///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(answer.status().as_u16())
///     })
///     .await?;
/// # let _ = status; Ok(()) }
/// ```
///
/// [`PropagateKeyLayer`]: super::PropagateKeyLayer
#[derive(Clone, Debug, Default)]
pub struct PropagateKey {
    cfg: Arc<Config>,
}

impl PropagateKey {
    /// The middleware with its defaults: header `Idempotency-Key`, POST and PATCH
    /// keyed, requests outside a body untouched.
    pub fn new() -> Self {
        Self::default()
    }

    config_methods!();
}

/// The key set on a call's first attempt, kept in the call's extensions for its later
/// attempts: the same header, method and URL.
#[derive(Clone)]
struct Chosen {
    header: HeaderName,
    method: Method,
    url: Url,
    key: HeaderValue,
}

#[async_trait::async_trait]
impl Middleware for PropagateKey {
    async fn handle(
        &self,
        mut req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let header = &self.cfg.header;
        let chosen = extensions
            .get::<Chosen>()
            .filter(|c| c.header == header && c.method == req.method() && c.url == *req.url())
            .map(|c| c.key.clone());
        let key = match chosen {
            // A later attempt of a call already keyed.
            Some(key) if !req.headers().contains_key(header) => Some(key),
            Some(_) => None,
            None => {
                let key =
                    self.cfg
                        .key_for(req.method(), req.url().path(), req.headers(), extensions);
                if let Some(key) = &key {
                    extensions.insert(Chosen {
                        header: header.clone(),
                        method: req.method().clone(),
                        url: req.url().clone(),
                        key: key.clone(),
                    });
                }
                key
            }
        };
        if let Some(key) = key {
            req.headers_mut().insert(header.clone(), key);
        }
        next.run(req, extensions).await
    }
}
