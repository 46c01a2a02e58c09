//! Calling other services: the running operation's downstream key, sent by the client,
//! so that two idempotent hops compose into one effect.
//!
//! idem protects the body it wraps; the effect that matters is often one hop further
//! (a payment provider, another team's service). A body re-run after a released error,
//! a crash or a takeover calls that service again, and only a key the service has seen
//! before stops the second effect. These layers send that key on every call the body
//! makes, so no call can forget it:
//!
//! - [`PropagateKeyLayer`], a tower layer for any `Service<http::Request<B>>` client
//!   (hyper-util's client, tonic channels, tower stacks), feature `client`;
//! - [`PropagateKey`], a `reqwest_middleware::Middleware`, feature `reqwest`;
//! - for JetStream, [`queue::message_id`](crate::queue::message_id) gives the
//!   `Nats-Msg-Id` of a publish.
//!
//! Inside an idempotent body, each POST or PATCH request (the methods are
//! [configurable](PropagateKeyLayer::methods)) gets `Idempotency-Key:
//! <key>` (the [header](PropagateKeyLayer::header) too), where `<key>` is
//! [`Current::downstream_key`](crate::Current::downstream_key)`(label)`: a SHA-256 of
//! the operation's scope, name and key and of the call's label, 64 hex digits. It is
//! the same on every retry, resume and takeover of the operation, so a receiver that
//! deduplicates by `Idempotency-Key` (idem's own [`IdempotencyLayer`], Stripe, any
//! server of the IETF draft) makes its effect once and answers the re-run with the
//! response it recorded.
//!
//! # The label
//!
//! | where the call is made | label |
//! |---|---|
//! | inside [`step`](crate::step)`("charge", ..)`, the step's first keyed call | `charge` |
//! | the same step's later keyed calls | `charge#1`, `charge#2`, … |
//! | inside that step, a request carrying [`KeyLabel`]`("refund")` | `charge/refund` |
//! | outside steps, a request carrying [`KeyLabel`]`("refund")` | `refund` |
//! | outside steps, otherwise | `POST /charges#0`: the method, the URL's path, and the call's ordinal among this run's unlabelled calls to that method and path outside steps |
//!
//! A keyed call is a request of a covered method or one carrying a [`KeyLabel`] (which
//! is keyed whatever its method); a request that already carries the header is left
//! alone and counts for nothing. The path is the URL's path only: the host is not part
//! of the label, so a call that moves to another host (a failover, a new base URL)
//! between two runs keeps its key. So a step's one call is keyed as
//! `current().downstream_key("charge")` is, and code that passed that key by hand
//! keeps its keys under the layer.
//!
//! **When the ordinal is stable.** Ordinals count afresh on every run of the body, and
//! a step's calls count afresh on every run of the step. Calls inside steps never count
//! among the body's, so a step replayed from the store (which makes no call) shifts no
//! ordinal. So an ordinal names the same call on every run
//! as long as the body is deterministic: it makes the same calls to the same endpoint
//! in the same order on every run. Label by hand (a step, or a [`KeyLabel`]) where it
//! is not: a call made only on some runs (behind a condition on the clock, on a cache,
//! on what another service answered), calls to one endpoint made concurrently (with
//! `join!`, whose order of polling can change), calls in a loop over data that can
//! change between runs (label them `KeyLabel(format!("refund:{id}"))`).
//!
//! **The request must be the same on every run.** The receiver fingerprints what it
//! got with the key; a re-run that sends another body (a timestamp, a random nonce) is
//! refused (idem answers 422). Build the request from the operation's input, or from
//! values recorded by an earlier step.
//!
//! # Outside an idempotent body
//!
//! A request made outside a body passes through untouched. With
//! [`key_per_request`](PropagateKeyLayer::key_per_request), a covered request gets a
//! fresh random key (a UUID v4, as Stripe's client libraries send) instead, and the
//! layers beneath it (a retry layer) send it again on each of their retries: one key
//! per logical request.
//!
//! # Where the layer goes
//!
//! Outside (above) any retry layer: the layer sets the header once, and the retries
//! beneath it resend the request with it. The layer reads the running body from the
//! task it is called on, so it must be called by the body's own task, as a client is
//! when the body awaits it: not from a task the body spawned, nor behind a layer that
//! moves the call to a task of its own (tower's `Buffer`) unless this layer is above
//! that one. Such a call goes out as one made outside a body.
//!
//! # The receiver
//!
//! The receiver deduplicates for as long as the caller may run the body again: keep
//! its records (`retain` on an idem receiver) at least as long as the caller's.
//! Between two idem services, the callee's record holds the response, so the caller's
//! re-run gets the callee's first answer and records that: both hops end with one
//! effect and one outcome.
//!
//! # Examples
//!
//! A tower stack (here around a stand-in client that answers with the header it got):
//!
//! ```
//! use http::Request;
//! use idem_runtime::client::{KeyLabel, PropagateKeyLayer};
//! use idem_runtime::{Idem, IdemError, current, step};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let client = ServiceBuilder::new()
//!     .layer(PropagateKeyLayer::new())
//!     // .retry(policy) goes here, beneath the layer; then the real client.
//!     .service(service_fn(|req: Request<String>| async move {
//!         let key = req.headers().get("idempotency-key").cloned();
//!         Ok::<_, IdemError>(key.map(|v| v.to_str().unwrap().to_owned()))
//!     }));
//! let post = |path: &str| Request::post(format!("https://payments.example{path}"));
//!
//! let idem = Idem::memory();
//! idem.operation("checkout", "order-1")
//!     .retain(std::time::Duration::from_secs(3600))
//!     .fingerprint_none()
//!     .run(|| async {
//!         let op = current();
//!         let sent = client.clone().oneshot(post("/charges").body(String::new())?).await?;
//!         assert_eq!(sent, Some(op.downstream_key("POST /charges#0")));
//!
//!         let mut labelled = post("/refunds").body(String::new())?;
//!         labelled.extensions_mut().insert(KeyLabel("refund"));
//!         let sent = client.clone().oneshot(labelled).await?;
//!         assert_eq!(sent, Some(op.downstream_key("refund")));
//!
//!         let mut client = client.clone();
//!         step("receipt", || async move {
//!             let req = post("/receipts").body(String::new())?;
//!             let sent = client.ready().await?.call(req).await?;
//!             assert_eq!(sent, Some(current().downstream_key("receipt")));
//!             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//!         })
//!         .await?;
//!         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! reqwest, with the key set before the retries of `reqwest-retry`: see
//! [`PropagateKey`].
//!
//! [`IdempotencyLayer`]: https://docs.rs/idem-runtime/latest/idem_runtime/http/struct.IdempotencyLayer.html

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{Extensions, HeaderMap, HeaderName, HeaderValue, Method};

use crate::context;

mod layer;
#[cfg(feature = "reqwest")]
mod middleware;
#[cfg(test)]
mod tests;

pub use layer::{PropagateKeyLayer, PropagateKeyService};
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use middleware::PropagateKey;

/// The header the layers set by default: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A request extension naming the call, for its key: `KeyLabel("charge")`, or
/// `KeyLabel(format!("refund:{id}"))` for a label built at run time.
///
/// Outside steps the label is the call's label; inside a step it qualifies the step's
/// (`charge/refund` in step `charge`). A request carrying one is keyed whatever its
/// method. Give each call of one run its own label: two calls with one label carry one
/// key, and the receiver answers the second with the first's response (or refuses it,
/// if the requests differ).
///
/// On an `http::Request`, insert it in the request's extensions; with reqwest-middleware,
/// `RequestBuilder::with_extension`:
///
/// ```
/// use idem_runtime::client::KeyLabel;
///
/// let mut req = http::Request::post("https://payments.example/refunds").body(()).unwrap();
/// req.extensions_mut().insert(KeyLabel("refund"));
/// let id = 42;
/// req.extensions_mut().insert(KeyLabel(format!("refund:{id}")));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyLabel<L: LabelText = &'static str>(pub L);

mod sealed {
    pub trait Sealed {}
    impl Sealed for &'static str {}
    impl Sealed for String {}
}

/// What a [`KeyLabel`] holds: a `&'static str` or a `String`, the two types the layers
/// look up in a request's extensions.
#[diagnostic::on_unimplemented(
    message = "a `KeyLabel` holds a `&'static str` or a `String`, not `{Self}`",
    label = "the client layers would not find this label",
    note = "convert it: `KeyLabel(label.to_string())`"
)]
pub trait LabelText: sealed::Sealed + Clone + Send + Sync + 'static {
    /// The label.
    fn as_label(&self) -> &str;
}

impl LabelText for &'static str {
    fn as_label(&self) -> &str {
        self
    }
}

impl LabelText for String {
    fn as_label(&self) -> &str {
        self
    }
}

/// The label a request carries, if any.
fn carried_label(ext: &Extensions) -> Option<&str> {
    ext.get::<KeyLabel<&'static str>>()
        .map(|l| l.0)
        .or_else(|| ext.get::<KeyLabel<String>>().map(|l| l.0.as_str()))
}

/// What both layers are configured with.
#[derive(Clone, Debug)]
struct Config {
    header: HeaderName,
    methods: Vec<Method>,
    per_request: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            header: IDEMPOTENCY_KEY,
            methods: vec![Method::POST, Method::PATCH],
            per_request: false,
        }
    }
}

impl Config {
    /// The key for a request, or `None` to send it untouched. Counts the call's
    /// ordinal, so it is called once per logical request.
    fn key_for(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
        ext: &Extensions,
    ) -> Option<HeaderValue> {
        if headers.contains_key(&self.header) {
            return None;
        }
        let carried = carried_label(ext);
        if carried.is_none() && !self.methods.contains(method) {
            return None;
        }
        let key = match context::with_body(|body| {
            let label = call_label(body, method, path, carried);
            tracing::debug!(label = %label, "idempotency key set on an outgoing request");
            body.current.downstream_key(&label)
        }) {
            Some(key) => key,
            None if self.per_request => fresh_key(),
            None => return None,
        };
        // Hex digits or a UUID: always a valid header value.
        HeaderValue::from_str(&key).ok()
    }
}

/// The label of a keyed call made in `body`, as the module's table says.
fn call_label(body: &context::Body, method: &Method, path: &str, carried: Option<&str>) -> String {
    let step = context::with_step(|s| {
        let label = s.label()?.clone();
        Some(match carried {
            Some(carried) => format!("{label}/{carried}"),
            None => match s.next_call() {
                0 => label.to_string(),
                n => format!("{label}#{n}"),
            },
        })
    })
    .flatten();
    match (step, carried) {
        (Some(label), _) => label,
        (None, Some(carried)) => carried.to_owned(),
        (None, None) => {
            let endpoint = format!("{method} {path}");
            let n = body.next_call(&endpoint);
            format!("{endpoint}#{n}")
        }
    }
}

/// A random key for a request made outside a body: a UUID v4 drawn from a SHA-256
/// stream seeded once per process from the OS's randomness (through std's hasher
/// keys), the process id and the clock.
fn fresh_key() -> String {
    use sha2::{Digest, Sha256};
    use std::hash::{BuildHasher, RandomState};
    static SEED: OnceLock<[u8; 32]> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = SEED.get_or_init(|| {
        let mut h = Sha256::new();
        h.update(b"idem-request-key-v1");
        for i in 0u64..4 {
            h.update(RandomState::new().hash_one(i).to_be_bytes());
        }
        h.update(std::process::id().to_be_bytes());
        if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.update(now.as_nanos().to_be_bytes());
        }
        h.finalize().into()
    });
    let mut h = Sha256::new();
    h.update(seed);
    h.update(NEXT.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    let digest = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    b[6] = (b[6] & 0x0f) | 0x40; // version 4
    b[8] = (b[8] & 0x3f) | 0x80; // RFC 4122 variant
    let hex: String = b.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// The builder methods both layers share.
macro_rules! config_methods {
    () => {
        /// The header to set (default `Idempotency-Key`,
        /// [`IDEMPOTENCY_KEY`](crate::client::IDEMPOTENCY_KEY)), for a
        /// receiver that reads another (`X-Idempotency-Key`).
        pub fn header(mut self, name: ::http::HeaderName) -> Self {
            ::std::sync::Arc::make_mut(&mut self.cfg).header = name;
            self
        }

        /// The methods whose requests are keyed (default POST and PATCH, the methods
        /// the IETF draft's header is for); a request of another method is keyed only
        /// when it carries a [`KeyLabel`](crate::client::KeyLabel).
        pub fn methods(mut self, methods: impl IntoIterator<Item = ::http::Method>) -> Self {
            ::std::sync::Arc::make_mut(&mut self.cfg).methods = methods.into_iter().collect();
            self
        }

        /// Outside an idempotent body, whether a covered request gets a fresh random
        /// key (a UUID v4) instead of passing through untouched (the default): one key
        /// per logical request, sent again by every retry beneath this layer, as
        /// Stripe's client libraries do. Inside a body the operation's key is sent
        /// either way.
        pub fn key_per_request(mut self, on: bool) -> Self {
            ::std::sync::Arc::make_mut(&mut self.cfg).per_request = on;
            self
        }
    };
}
use config_methods;
