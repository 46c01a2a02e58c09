//! A toy payment provider over real HTTP on 127.0.0.1: it deduplicates charges by the
//! `Idempotency-Key` it is given, as real providers do, counts every effect, and offers
//! the status lookup a reconciler needs.
//!
//! - `POST /charges` with `Idempotency-Key: K` and `{"amount_cents": N}`: 201 and the
//!   new charge, or 200 and the charge already made for `K`.
//! - `GET /charges/{K}`: 200 and the charge made for `K`, or 404 if none was.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// A charge the provider made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Charge {
    pub id: u64,
    pub key: String,
    pub amount_cents: i64,
}

#[derive(Deserialize)]
struct ChargeRequest {
    amount_cents: i64,
}

#[derive(Default)]
struct Ledger {
    charges: HashMap<String, Charge>,
    /// Requests per key, replays included.
    requests: HashMap<String, u64>,
    next_id: u64,
}

/// The running provider.
#[derive(Clone)]
pub struct Provider {
    pub addr: SocketAddr,
    ledger: Arc<Mutex<Ledger>>,
}

impl Provider {
    /// Serves on `127.0.0.1` at a free port until the runtime stops.
    pub async fn start() -> Provider {
        Provider::start_on("127.0.0.1:0").await
    }

    /// Serves on `addr`.
    pub async fn start_on(addr: &str) -> Provider {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let app = Router::new()
            .route("/charges", post(create))
            .route("/charges/{key}", get(lookup))
            .with_state(ledger.clone());
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Provider { addr, ledger }
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many charges exist: one per distinct key, whatever was retried.
    pub fn effects(&self) -> usize {
        self.ledger.lock().unwrap().charges.len()
    }

    /// The charge made for `key`.
    pub fn charge(&self, key: &str) -> Option<Charge> {
        self.ledger.lock().unwrap().charges.get(key).cloned()
    }

    /// How many requests came for `key`, the first and every deduplicated retry.
    pub fn requests(&self, key: &str) -> u64 {
        self.ledger
            .lock()
            .unwrap()
            .requests
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

async fn create(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<(StatusCode, Json<Charge>), (StatusCode, &'static str)> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .ok_or((StatusCode::BAD_REQUEST, "Idempotency-Key header required"))?
        .to_owned();
    let mut ledger = ledger.lock().unwrap();
    *ledger.requests.entry(key.clone()).or_default() += 1;
    if let Some(existing) = ledger.charges.get(&key) {
        return Ok((StatusCode::OK, Json(existing.clone())));
    }
    ledger.next_id += 1;
    let charge = Charge {
        id: ledger.next_id,
        key: key.clone(),
        amount_cents: req.amount_cents,
    };
    ledger.charges.insert(key, charge.clone());
    Ok((StatusCode::CREATED, Json(charge)))
}

async fn lookup(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    Path(key): Path<String>,
) -> Result<Json<Charge>, StatusCode> {
    let ledger = ledger.lock().unwrap();
    ledger
        .charges
        .get(&key)
        .cloned()
        .map(Json)
        .ok_or(StatusCode::NOT_FOUND)
}
