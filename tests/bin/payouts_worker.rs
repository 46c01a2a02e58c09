//! A payouts service for tests/suite/http_accepted.rs: `POST /payouts` behind
//! `IdempotencyLayer::accept_after`, with the status resource at `/operations`, on a
//! PostgreSQL table. Each run of the handler inserts `(key, epoch)` into `RUNS` and
//! prints `ran KEY EPOCH`; with `--hang` it then never ends (the test kills the process).
//! Prints `listening ADDR` once it serves.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::Parser;
use idem_runtime::Idem;
use idem_runtime::http::{IdempotencyLayer, Principal, status_routes};
use serde_json::json;
use sqlx::PgPool;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    url: String,
    #[arg(long)]
    table: String,
    /// The table of handler runs.
    #[arg(long)]
    runs: String,
    #[arg(long, default_value_t = 1000)]
    lease_ms: u64,
    /// How long a request runs before it is answered 202.
    #[arg(long, default_value_t = 100)]
    accept_ms: u64,
    #[arg(long)]
    hang: bool,
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    runs: String,
    hang: bool,
}

async fn payout(State(app): State<App>, headers: HeaderMap) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let epoch = idem_runtime::try_current().map_or(0, |c| c.epoch());
    let insert = format!("INSERT INTO {} (key, epoch) VALUES ($1, $2)", app.runs);
    sqlx::query(&insert)
        .bind(&key)
        .bind(i64::try_from(epoch).unwrap_or(i64::MAX))
        .execute(&app.pool)
        .await
        .expect("record the run");
    println!("ran {key} {epoch}");
    if app.hang {
        std::future::pending::<()>().await;
    }
    (
        StatusCode::CREATED,
        Json(json!({"key": key, "epoch": epoch})),
    )
        .into_response()
}

async fn auth(mut req: Request, next: Next) -> Response {
    let who = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    match who {
        Some(who) => {
            req.extensions_mut().insert(Principal::new(who));
            next.run(req).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let idem = Idem::builder()
        .status_secret([7u8; 32])
        .replay_cache_bytes(0)
        .table(args.table.clone())
        .postgres(&args.url)
        .await
        .expect("open the store");
    let pool = PgPool::connect(&args.url).await.expect("connect");
    let layer = IdempotencyLayer::new(idem.clone())
        .lease(Duration::from_millis(args.lease_ms))
        .accept_after(Duration::from_millis(args.accept_ms));
    let app = Router::new()
        .route("/payouts", post(payout))
        .with_state(App {
            pool,
            runs: args.runs,
            hang: args.hang,
        })
        .layer(layer)
        .nest("/operations", status_routes(&idem))
        .layer(middleware::from_fn(auth));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("listening {}", listener.local_addr().unwrap());
    axum::serve(listener, app).await.unwrap();
}
