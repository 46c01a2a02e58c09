//! HTTP services on axum: the `Idempotency-Key` header of the IETF httpapi draft.
//!
//! Two ways to use it:
//!
//! - **On handlers.** Put `#[idempotent]` on the handler, take the key with the
//!   [`IdempotencyKey`] extractor and the caller with [`Principal`], scope by the
//!   principal, and wrap the routes in [`IdempotentHandlerLayer`] (replay header,
//!   handlers run to completion). Errors answer through `IntoResponse for IdemError`.
//!   Without the layer the routes still work, but replays go out without
//!   `Idempotent-Replayed`; the first key extracted on such a route logs a warning
//!   (once per process) saying to add it.
//!
//!   ```
//!   use axum::{Json, Router, extract::State, routing::post};
//!   use idem_runtime::http::{IdempotencyKey, IdempotentHandlerLayer, Principal, Problem};
//!   use idem_runtime::{Idem, IdemError, idempotent};
//!   use serde::{Deserialize, Serialize};
//!
//!   #[derive(Serialize, Deserialize)]
//!   struct Transfer { cents: u64 }
//!
//!   #[derive(Serialize, Deserialize)]
//!   struct Receipt { id: u64 }
//!   # impl axum::response::IntoResponse for Receipt {
//!   #     fn into_response(self) -> axum::response::Response { Json(self).into_response() }
//!   # }
//!
//!   struct ApiError(Problem);
//!   impl From<IdemError> for ApiError {
//!       fn from(e: IdemError) -> Self { ApiError(e.into()) }
//!   }
//!   impl axum::response::IntoResponse for ApiError {
//!       fn into_response(self) -> axum::response::Response { self.0.into_response() }
//!   }
//!
//!   #[idempotent(store = idem, key = key, scope = principal, retain = "24h", in_flight = reject)]
//!   async fn transfer(
//!       #[idem(skip)] State(idem): State<Idem>,
//!       #[idem(skip)] principal: Principal,
//!       #[idem(skip)] key: IdempotencyKey,
//!       Json(t): Json<Transfer>,
//!   ) -> Result<Receipt, ApiError> {
//!       Ok(Receipt { id: t.cents })
//!   }
//!
//!   let app: Router<Idem> = Router::new()
//!       .route("/transfers", post(transfer))
//!       .layer(IdempotentHandlerLayer::new());
//!   ```
//!
//! - **On a router.** [`IdempotencyLayer`] makes every POST and PATCH below it
//!   idempotent without touching handlers: it takes the key from the header and the
//!   scope from the [`Principal`] the auth layer set, names the operation by its route,
//!   fingerprints the request (canonical query, media type, JSON and form bodies by
//!   content), records and replays the responses its handlers produced, and bounds
//!   what it buffers and what one caller can claim.
//!
//! `Idempotent-Replayed: true` marks a replay only: a response whose handler ran for
//! this request (a first execution, or a re-run after a released error) never carries
//! the header, in either style, so its absence means the handler ran.
//!
//! Status codes (bodies are `application/problem+json`, RFC 9457, their `type` one of
//! the [`types`] names under a base: `urn:idem:problem:` ([`DEFAULT_TYPE_BASE`], which
//! names no web domain) unless [`set_type_base`] put them under the application's own,
//! such as `https://api.example.com/problems/`):
//!
//! | case | status |
//! |---|---|
//! | replay of a recorded response (success or error) | the recorded one, with `Idempotent-Replayed: true` |
//! | key missing, empty, malformed, not printable ASCII, over 255 characters | 400 |
//! | a request with this key is in progress | 409, `Retry-After` |
//! | key reused with another request | 422 |
//! | JSON body repeating a member name in one object (layer) | 422 |
//! | request body over the layer's cap (a declared `Content-Length` before the body is read) | 413 |
//! | request body not arrived within the layer's read timeout | 408 |
//! | more request bodies at once than the layer's buffer budget holds | 503, `Retry-After` |
//! | more new keys from one caller than the layer's claim limit allows | 429, `Retry-After` |
//! | store down, or no store configured (the request did not run) | 503, `Retry-After` |
//! | outcome unknown or unrecorded (being reconciled) | 500 |
//! | no principal set by the application | 500 |
//!
//! # The key
//!
//! [`IdempotencyKey`] takes the draft's structured-field string (`"8e03-..."`) and the
//! bare keys Stripe-style clients send (`8e03-...`) as the same key: 1 to 255 printable
//! ASCII characters. `Option<IdempotencyKey>` accepts requests without the header. A
//! bad key's problem body names the `header` and the `rule` it broke.
//!
//! # Errors in the application's own shape
//!
//! Clients of an API read its errors in one shape: a Stripe client looks for an `error`
//! object, and takes a problem+json body for an invalid response. idem's answers can
//! take that shape. On the layer, [`IdempotencyLayer::problem_response`] renders every
//! answer the layer makes itself; in the handler style, the error type's
//! `IntoResponse` answers its `IdemError` with [`error_response`] and the same render
//! function. Either way the function gets a [`Problem`] ([`Problem::kind`] names the
//! case, [`Problem::message`] says what to do, `retry_after` how long to wait) and
//! chooses the status and body; `Retry-After` is added when it sets none. In the
//! handler style a refused `Idempotency-Key` header is the [`IdempotencyKey`]
//! extractor's rejection, a [`Problem`]: wrap the extractor (axum-extra's
//! `WithRejection`, with `From<Problem>` for the error type) to render it too.
//!
//! # Handlers return domain types
//!
//! The outcome is recorded, so it must be a serde type: axum's `Json<T>` has no serde
//! impls. Return a domain type that implements `IntoResponse`, and an error type with
//! `From<IdemError>` that answers idem's errors through [`Problem`] (as `ApiError` does
//! above). Server-side cases are logged with the full error; the response never carries
//! a database message.
//!
//! # What the layer records
//!
//! [`IdempotencyLayer`] records the response's status, selected headers
//! (`content-type`, `location`, `content-language`, `etag`, and any added with
//! [`record_header`](IdempotencyLayer::record_header)) and body, and replays them; the
//! first answer is the handler's response as it was made, every header included. As
//! Stripe does, it records every response the handlers produce once they may have
//! started, 5xx included ([`records_by_default`](IdempotencyLayer::records_by_default)):
//! a 5xx after a handler ran is an outcome of unknown effect, and releasing it would let
//! a client that retries every 5xx with one key run the effect twice. A refusal made
//! before the operation ran (a framework's 400, 405, 413, 415 or 422) or a "try again"
//! (408, 425, 429) is passed on unrecorded and releases the key, so the corrected retry
//! runs; [`release_status`](IdempotencyLayer::release_status) adds a status the
//! application answers only when nothing happened, and
//! [`record_status`](IdempotencyLayer::record_status) replaces the policy. What the
//! layer answers itself (refused key or body, store down, in flight, key reused) is
//! never recorded.
//!
//! In the handler style the attribute decides: an `Err` is released unless `errors =
//! record` or `classify` says otherwise, so a handler error that may follow an effect
//! should be classified `Record` (or `Unknown`), or the effect made safe to repeat with
//! a downstream key, as the example's payments are.
//!
//! # Disconnects
//!
//! axum drops a handler's future when the client goes away, which would stop the body
//! mid-effect and hold its key until the lease lapses. Both layers run the request in a
//! task of its own instead (`run_to_completion(false)` turns that off), so it finishes
//! and records its outcome, and the client's retry gets the replay.
//!
//! # Why the principal belongs in the scope
//!
//! Clients choose idempotency keys, so two clients can send the same one, by accident (a
//! shared generator, a copied script) or on purpose. Without the principal in the
//! scope, the second client would get the first one's recorded response (another
//! customer's payment) or a 422 telling it that the key exists. With it, the same key
//! from two principals is two operations. For the same reason a replay is not
//! authorization: authenticate before the idempotent call, as for a first call. The
//! layer refuses to run without a principal rather than fall back to a shared scope.
//!
//! # Where the auth layer goes
//!
//! In both styles the auth layer runs first: it authenticates the request, refuses it
//! (401, 403) before anything idempotent runs, and inserts the [`Principal`]. axum runs
//! the last `.layer` added first, so the auth layer is added after idem's:
//!
//! - **On a router**, [`IdempotencyLayer`] sits inside the auth layer, which it reads
//!   the principal from (a request without one is refused with a 500 that says so).
//! - **On handlers**, [`IdempotentHandlerLayer`] sits inside it too, so a refused
//!   request never starts a handler task, and the handler extracts the [`Principal`]
//!   for its `scope`.
//!
//! A replay does not run the handler, so a check made inside it is not made again for
//! the replay. Authorization that must hold for every answer (may this principal still
//! make this transfer?) belongs in the auth layer, in an extractor, or in a handler
//! that checks and then calls an `#[idempotent]` function, never inside the
//! idempotent body alone.
//!
//! ```
//! use axum::{Router, extract::Request, middleware::{self, Next}, response::Response, routing::post};
//! use idem_runtime::Idem;
//! use idem_runtime::http::{IdempotencyLayer, IdempotentHandlerLayer, Principal};
//! # async fn create_order() {}
//! # async fn transfer() {}
//!
//! async fn auth(mut req: Request, next: Next) -> Response {
//!     // Check the credentials here and answer 401 without calling `next`.
//!     req.extensions_mut().insert(Principal::new("user-42"));
//!     next.run(req).await
//! }
//!
//! let orders: Router = Router::new() // on a router
//!     .route("/orders", post(create_order))
//!     .route_layer(IdempotencyLayer::new(Idem::memory()))
//!     .layer(middleware::from_fn(auth));
//! let transfers: Router = Router::new() // on handlers
//!     .route("/transfers", post(transfer))
//!     .layer(IdempotentHandlerLayer::new())
//!     .layer(middleware::from_fn(auth));
//! # let _ = (orders, transfers);
//! ```
//!
//! The workspace's `examples/http_payments.rs` is a payments API with both styles, and
//! its first lines show a `curl` retry.

mod canonical;
mod estimate;
mod handler;
mod key;
mod layer;
mod limits;
mod principal;
mod problem;
mod rejection;
mod spawned;

pub use handler::{IdempotentHandler, IdempotentHandlerLayer};
pub use key::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKey};
pub use layer::{IdempotencyLayer, IdempotencyService, status_routes};
pub use principal::Principal;
pub use problem::{
    DEFAULT_TYPE_BASE, Problem, STORE_RETRY_AFTER, error_response, set_type_base, type_uri, types,
};
pub use rejection::{KeyRejection, MAX_KEY_LEN};
