//! A checkout of three steps (reserve, charge, receipt) that survives a crash between them.
//!
//! ```sh
//! cargo run -p idem-tests --example checkout -- --crash-after charge   # exits after the charge
//! cargo run -p idem-tests --example checkout                           # resumes: runs the receipt
//! cargo run -p idem-tests --example checkout                           # completed: replays
//! # SQLite file: IDEM_EXAMPLE_DB (default ./checkout.db); a fresh order: --order order-2
//! ```
//!
//! Each step is an `idem_runtime::step`: run once per order, its value recorded before
//! the next starts. A run that crashed leaves its steps recorded; the next run takes
//! the claim over once its lease lapses, replays those steps without running them, and
//! runs the rest. The reservation, the provider's charges and the outbox are tables of
//! the same SQLite file, counted at the end: one of each, however the runs went. The
//! payment provider is a stand-in over real HTTP on 127.0.0.1, in this process, that
//! deduplicates by `Idempotency-Key` and keeps its charges in that file too, so a second
//! run sees what the crashed one charged.

use std::fmt::Debug;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use clap::{Parser, ValueEnum};
use idem_runtime::{BoxError, Idem, InFlight, current, observe, step};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;

/// Check out an order in three steps, optionally crashing after one of them.
#[derive(Parser, Debug)]
struct Args {
    /// The order: the checkout's key.
    #[arg(long, default_value = "order-1")]
    order: String,
    /// Exit at once, as a crash, right after this step is recorded.
    #[arg(long, value_enum)]
    crash_after: Option<StepName>,
    /// The SQLite file holding idem's records and the example's tables.
    #[arg(long, env = "IDEM_EXAMPLE_DB", default_value = "checkout.db")]
    db: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StepName {
    Reserve,
    Charge,
    Receipt,
}

impl StepName {
    fn label(self) -> &'static str {
        match self {
            StepName::Reserve => "reserve",
            StepName::Charge => "charge",
            StepName::Receipt => "receipt",
        }
    }
}

/// The exit status of a simulated crash.
const CRASH_STATUS: i32 = 3;

/// Short, so the run after a crash takes the claim over within seconds.
const LEASE: Duration = Duration::from_secs(2);

const AMOUNT_CENTS: i64 = 2500;

/// A charge the provider made.
#[derive(Debug, Serialize, Deserialize)]
struct Charge {
    id: i64,
    amount_cents: i64,
}

/// `step`, saying whether its closure ran or its recorded value replayed, and crashing
/// right after the step is recorded when `--crash-after` names it.
async fn checkpoint<T, F, Fut>(
    name: StepName,
    crash_after: Option<StepName>,
    f: F,
) -> Result<T, BoxError>
where
    T: Serialize + DeserializeOwned + Debug,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T, BoxError>>,
{
    let label = name.label();
    let ran = AtomicBool::new(false);
    let value = step(label, || {
        ran.store(true, Ordering::Relaxed);
        println!("ran {label}");
        f()
    })
    .await?;
    if !ran.load(Ordering::Relaxed) {
        println!("replayed {label}");
    }
    println!("  {label}: {value:?}");
    if crash_after == Some(name) {
        println!("crashing after {label}: exiting now, with no cleanup");
        // No destructors, no release: the claim stays leased until its lease lapses.
        std::process::exit(CRASH_STATUS);
    }
    Ok(value)
}

async fn checkout(
    idem: &Idem,
    db: &SqlitePool,
    http: &reqwest::Client,
    provider: &str,
    order: &str,
    crash_after: Option<StepName>,
) -> Result<String, BoxError> {
    idem.operation("checkout", order)
        .retain(Duration::from_secs(86_400))
        .fingerprint(&AMOUNT_CENTS)
        .lease(LEASE)
        // A run after a crash finds the crashed run's claim still leased (renewals stop
        // with the process, so it lapses within `LEASE`): it waits that out, claims
        // again as it lapses and takes over, instead of answering `InFlight` at once.
        .in_flight(InFlight::Wait(LEASE * 5))
        .run(|| async {
            // Each effect is keyed by the step's downstream key, the same on every run:
            // a crash after the effect but before its step is recorded repeats nothing.
            let reservation: i64 = checkpoint(StepName::Reserve, crash_after, || async {
                let key = current().downstream_key("reserve");
                sqlx::query(
                    "INSERT INTO reservations (order_id, effect_key) VALUES ($1, $2)
                     ON CONFLICT (effect_key) DO NOTHING",
                )
                .bind(order)
                .bind(&key)
                .execute(db)
                .await?;
                let id = sqlx::query_scalar("SELECT id FROM reservations WHERE effect_key = $1")
                    .bind(&key)
                    .fetch_one(db)
                    .await?;
                Ok(id)
            })
            .await?;

            let charge: Charge = checkpoint(StepName::Charge, crash_after, || async {
                let charge = http
                    .post(format!("{provider}/charges"))
                    .header("Idempotency-Key", current().downstream_key("charge"))
                    .json(&serde_json::json!({ "order": order, "amount_cents": AMOUNT_CENTS }))
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                Ok(charge)
            })
            .await?;

            checkpoint(StepName::Receipt, crash_after, || async {
                let text = format!(
                    "{order}: reservation {reservation}, charge {} of {} cents",
                    charge.id, charge.amount_cents
                );
                sqlx::query(
                    "INSERT INTO outbox (order_id, effect_key, body) VALUES ($1, $2, $3)
                     ON CONFLICT (effect_key) DO NOTHING",
                )
                .bind(order)
                .bind(current().downstream_key("receipt"))
                .bind(&text)
                .execute(db)
                .await?;
                Ok(text)
            })
            .await
        })
        .await
}

#[derive(Deserialize)]
struct ChargeRequest {
    order: String,
    amount_cents: i64,
}

/// The provider's `POST /charges`: one charge per `Idempotency-Key`, kept in SQLite.
async fn create_charge(
    State(db): State<SqlitePool>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<Json<Charge>, (StatusCode, String)> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .ok_or((StatusCode::BAD_REQUEST, "Idempotency-Key required".into()))?;
    let failed = |e: sqlx::Error| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    sqlx::query(
        "INSERT INTO provider_charges (idempotency_key, order_id, amount_cents)
         VALUES ($1, $2, $3) ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(key)
    .bind(&req.order)
    .bind(req.amount_cents)
    .execute(&db)
    .await
    .map_err(failed)?;
    let (id, amount_cents) =
        sqlx::query_as("SELECT id, amount_cents FROM provider_charges WHERE idempotency_key = $1")
            .bind(key)
            .fetch_one(&db)
            .await
            .map_err(failed)?;
    Ok(Json(Charge { id, amount_cents }))
}

/// Serves the provider on a free port of 127.0.0.1; returns its base URL.
async fn start_provider(db: SqlitePool) -> Result<String, BoxError> {
    let app = Router::new()
        .route("/charges", post(create_charge))
        .with_state(db);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// The example's tables, beside idem's in one file.
async fn open(path: &Path) -> Result<SqlitePool, BoxError> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full);
    let db = SqlitePool::connect_with(opts).await?;
    for table in [
        "reservations (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL,
            effect_key TEXT NOT NULL UNIQUE)",
        "provider_charges (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL,
            idempotency_key TEXT NOT NULL UNIQUE, amount_cents INTEGER NOT NULL)",
        "outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL,
            effect_key TEXT NOT NULL UNIQUE, body TEXT NOT NULL)",
    ] {
        sqlx::query(&format!("CREATE TABLE IF NOT EXISTS {table}"))
            .execute(&db)
            .await?;
    }
    Ok(db)
}

#[tokio::main]
pub async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let db = open(&args.db).await?;
    let idem = Idem::sqlite(&format!("sqlite://{}", args.db.display())).await?;
    let provider = start_provider(db.clone()).await?;
    let http = reqwest::Client::new();

    println!("checking out {}", args.order);
    let (receipt, info) = observe(checkout(
        &idem,
        &db,
        &http,
        &provider,
        &args.order,
        args.crash_after,
    ))
    .await;
    let receipt = receipt?;
    // Epoch 1 is the first run to claim the order; a later one (after a crash, here) is higher.
    if let Some(epoch) = info.epoch().filter(|&e| e > 1) {
        println!("ran at epoch {epoch}: an earlier run left the checkout unfinished");
    }
    if info.replayed() {
        println!(
            "{} completed earlier: its receipt replayed, no step ran",
            args.order
        );
    }
    println!("receipt: {receipt}");

    let mut counts = Vec::new();
    for table in ["reservations", "provider_charges", "outbox"] {
        let n: i64 =
            sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE order_id = $1"))
                .bind(&args.order)
                .fetch_one(&db)
                .await?;
        counts.push(format!("{table}={n}"));
    }
    println!("counts for {}: {}", args.order, counts.join(" "));
    Ok(())
}
