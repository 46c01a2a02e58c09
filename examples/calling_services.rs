//! One service calling another, two idempotent hops and one effect.
//!
//! ```sh
//! cargo run -p idem-tests --example calling_services
//! ```
//!
//! Service B (payments) is axum with `IdempotencyLayer`: it charges once per
//! `Idempotency-Key` and answers a repeated key with the response it recorded. Service A
//! (orders) has an `#[idempotent]` `place_order` whose body calls B through reqwest,
//! with idem's `PropagateKey` middleware ahead of reqwest-retry's: the call carries the
//! order's downstream key, the same on each retry of the call and on each run of the
//! body. A's first run charges at B, then fails (the warehouse is down) and releases the
//! order; A's retry runs the body again, B replays its charge, and A records it: one
//! charge, and both services agree on it. Each service has its own store (memory here;
//! PostgreSQL schemas of their own in `tests/suite/client.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::client::PropagateKey;
use idem_runtime::http::{IdempotencyLayer, Principal};
use idem_runtime::{Idem, IdemError, idempotent};
use reqwest_middleware::ClientWithMiddleware;
use reqwest_retry::RetryTransientMiddleware;
use reqwest_retry::policies::ExponentialBackoff;
use serde::{Deserialize, Serialize};

/// B's answer to `POST /charges`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Charge {
    id: i64,
    amount_cents: i64,
}

/// Service B: every charge it made.
#[derive(Clone, Default)]
struct Payments {
    made: Arc<AtomicI64>,
}

async fn charge(
    State(payments): State<Payments>,
    Json(req): Json<serde_json::Value>,
) -> (StatusCode, Json<Charge>) {
    let id = payments.made.fetch_add(1, Ordering::SeqCst) + 1;
    let amount_cents = req["amount_cents"].as_i64().unwrap_or(0);
    println!("B: charge {id} made ({amount_cents} cents)");
    (StatusCode::CREATED, Json(Charge { id, amount_cents }))
}

/// B's callers authenticate; here every caller is service A.
async fn auth(mut req: Request, next: Next) -> Response {
    req.extensions_mut()
        .insert(Principal::new("orders-service"));
    next.run(req).await
}

/// Starts B on 127.0.0.1; its base URL.
async fn start_payments(payments: Payments) -> String {
    let app = Router::new()
        .route("/charges", post(charge))
        .route_layer(IdempotencyLayer::new(Idem::memory()))
        .layer(middleware::from_fn(auth))
        .with_state(payments);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[derive(Debug, thiserror::Error)]
enum OrderError {
    #[error("payments: {0}")]
    Payments(String),
    #[error("the warehouse is down")]
    WarehouseDown,
    #[error(transparent)]
    Idem(#[from] IdemError),
}

/// A's order: its body charges at B (keyed by the layer, not by hand) and reserves
/// stock; a failure releases the order, and its retry runs the body again.
#[idempotent(store = orders, key = order_id, retain = "7d")]
async fn place_order(
    orders: &Idem,
    #[idem(skip)] payments: &ClientWithMiddleware,
    #[idem(skip)] payments_url: &str,
    order_id: &str,
    amount_cents: i64,
    #[idem(skip)] warehouse_up: bool,
) -> Result<Charge, OrderError> {
    let answer = payments
        .post(format!("{payments_url}/charges"))
        .json(&serde_json::json!({ "order": order_id, "amount_cents": amount_cents }))
        .send()
        .await
        .map_err(|e| OrderError::Payments(e.to_string()))?;
    let replayed = answer.headers().contains_key("idempotent-replayed");
    let charge: Charge = answer
        .error_for_status()
        .map_err(|e| OrderError::Payments(e.to_string()))?
        .json()
        .await
        .map_err(|e| OrderError::Payments(e.to_string()))?;
    println!(
        "A: B answered charge {}{}",
        charge.id,
        if replayed {
            " (its recorded response)"
        } else {
            ""
        }
    );
    if !warehouse_up {
        return Err(OrderError::WarehouseDown);
    }
    Ok(charge)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let payments = Payments::default();
    let payments_url = start_payments(payments.clone()).await;

    // PropagateKey first, then the retry middleware: one key per call, on every retry.
    let retry = ExponentialBackoff::builder().build_with_max_retries(3);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(PropagateKey::new())
        .with(RetryTransientMiddleware::new_with_policy(retry))
        .build();
    let orders = Idem::memory();

    let first = place_order(&orders, &client, &payments_url, "order-7", 4200, false).await;
    println!("A: first run: {}", first.unwrap_err());
    let charge = place_order(&orders, &client, &payments_url, "order-7", 4200, true).await?;
    println!("A: order-7 placed with charge {}", charge.id);

    let made = payments.made.load(Ordering::SeqCst);
    println!("B made {made} charge(s)");
    assert_eq!(made, 1, "two runs of A's body, one charge at B");
    Ok(())
}
