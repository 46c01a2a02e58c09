//! HTTP services on axum: the `Idempotency-Key` header of the IETF httpapi draft.
//!
//! Two ways to use it:
//!
//! - **On handlers.** Put `#[idempotent]` on the handler, take the key with the
//!   [`IdempotencyKey`] extractor and the caller with [`Principal`], scope by the
//!   principal, and wrap the routes in [`IdempotentHandlerLayer`] (replay header,
//!   handlers run to completion). Errors answer through `IntoResponse for IdemError`.
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
//!   scope from the [`Principal`] the auth layer set, fingerprints the request, and
//!   records and replays the response.
//!
//! Status codes (bodies are `application/problem+json`, RFC 9457, with the [`types`]
//! URIs):
//!
//! | case | status |
//! |---|---|
//! | replay of a recorded response (success or error) | the recorded one, with `Idempotent-Replayed: true` |
//! | key missing, empty, malformed, not printable ASCII, over 255 characters | 400 |
//! | a request with this key is in progress | 409, `Retry-After` |
//! | key reused with another request | 422 |
//! | request body over the layer's cap | 413 |
//! | store down, or no store configured (the request did not run) | 503, `Retry-After` |
//! | outcome unknown or unrecorded (being reconciled) | 500 |
//! | no principal set by the application | 500 |

mod handler;
mod key;
mod layer;
mod principal;
mod problem;

pub use handler::{IdempotentHandler, IdempotentHandlerLayer};
pub use key::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKey, KeyRejection, MAX_KEY_LEN};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use principal::Principal;
pub use problem::{Problem, STORE_RETRY_AFTER, types};
