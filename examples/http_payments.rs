//! A payments API over HTTP where a retried POST never pays twice.
//!
//! ```sh
//! cargo run -p idem-tests --example http_payments -- --addr 127.0.0.1:3000
//! # SQLite file: IDEM_EXAMPLE_DB (default ./http_payments.db); PostgreSQL: IDEM_POSTGRES_URL=postgres://...
//! curl -i localhost:3000/payments -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: "5f0c1e2a-order-77"' -H 'Content-Type: application/json' \
//!      -d '{"amount_cents": 1999, "currency": "EUR"}'
//! # the same command again: the same payment, with `Idempotent-Replayed: true`;
//! # the same key with another amount: 422; the same key as `Bearer bob`: bob's own payment.
//! ```
//!
//! `POST /payments` is an `#[idempotent]` handler scoped by the caller; the same API
//! under `/layer/payments` has plain handlers behind `IdempotencyLayer`.
//! `POST /layer/payouts` takes 3 seconds: it is answered `202 Accepted` after one, with
//! a `Location` under `/operations/` that answers `202` until the payout is made, then
//! the `201` it recorded. Every payment
//! is one row of the `payments` table in the same database as idem's records, so
//! effects can be counted from outside.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_runtime::http::{
    IdempotencyKey, IdempotencyLayer, IdempotentHandlerLayer, Principal, Problem, status_routes,
};
use idem_runtime::{Disposition, Idem, IdemError, idempotent};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

/// The request body of `POST /payments`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NewPayment {
    pub amount_cents: i64,
    pub currency: String,
}

/// A payment made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Payment {
    pub id: i64,
    pub amount_cents: i64,
    pub currency: String,
}

/// `201 Created` with the payment: a domain type, so idem can record it (axum's `Json`
/// has no serde impls).
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
pub struct Created(pub Payment);

impl IntoResponse for Created {
    fn into_response(self) -> Response {
        (StatusCode::CREATED, Json(self.0)).into_response()
    }
}

/// The API's errors. Business answers are recorded and replayed to retries; idem's
/// and the database's are not (a retry runs again).
#[derive(Debug, Serialize, Deserialize)]
pub enum ApiError {
    /// 402: the payment was refused; final, so recorded.
    Declined { reason: String },
    /// 400: the request makes no sense; recorded as well.
    Invalid { reason: String },
    #[serde(skip)]
    NotFound,
    #[serde(skip)]
    Idem(IdemError),
    #[serde(skip)]
    Db(String),
}

impl From<IdemError> for ApiError {
    fn from(e: IdemError) -> Self {
        ApiError::Idem(e)
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::Db(e.to_string())
    }
}

/// `classify` for the handler: record business answers, release the rest.
pub fn classify(e: &ApiError) -> Disposition {
    match e {
        ApiError::Declined { .. } | ApiError::Invalid { .. } => Disposition::Record,
        _ => Disposition::Release,
    }
}

/// The base of this API's problem `type` URIs, idem's own included (see `main`).
pub const PROBLEM_BASE: &str = "https://payments.example/problems/";

/// A problem of this API's own, its `type` under [`PROBLEM_BASE`].
fn problem(status: StatusCode, kind: &str, title: &str) -> Problem {
    Problem::new(status, format!("{PROBLEM_BASE}{kind}"), title)
}

/// A JSON request body; one that cannot be read (malformed, the wrong shape, another
/// media type) is answered as problem+json like every other error of this API, with
/// axum's status and its reason as the detail.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(JsonBody(value)),
            Err(rejection) => Err(problem(
                rejection.status(),
                "unreadable-body",
                "Request body not accepted",
            )
            .detail(rejection.body_text())),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Declined { reason } => {
                problem(StatusCode::PAYMENT_REQUIRED, "declined", "Payment declined")
                    .detail(reason)
                    .into_response()
            }
            ApiError::Invalid { reason } => problem(
                StatusCode::BAD_REQUEST,
                "invalid-payment",
                "Invalid payment",
            )
            .detail(reason)
            .into_response(),
            ApiError::NotFound => {
                problem(StatusCode::NOT_FOUND, "not-found", "No such payment").into_response()
            }
            ApiError::Idem(e) => e.into_response(),
            ApiError::Db(e) => {
                eprintln!("database error: {e}");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "Internal error",
                )
                .into_response()
            }
        }
    }
}

/// The database holding the payments (and idem's records).
#[derive(Clone)]
pub enum Db {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
}

/// Holds every payment just before it is written, until released: tests use it to
/// keep a request in flight and to disconnect mid-request. `None` when run as a binary.
pub struct Hold {
    /// A permit is added as each held request arrives.
    pub entered: Semaphore,
    /// Each held request takes one permit to go on.
    pub release: Semaphore,
}

impl Default for Hold {
    fn default() -> Self {
        Hold {
            entered: Semaphore::new(0),
            release: Semaphore::new(0),
        }
    }
}

/// idem as this API uses it: status URLs of accepted payouts keyed with
/// `IDEM_STATUS_SECRET` (a fixed one in development).
fn idem_builder() -> idem_runtime::IdemBuilder {
    let secret = std::env::var("IDEM_STATUS_SECRET")
        .unwrap_or_else(|_| "development-only-status-secret!".into());
    Idem::builder().status_secret(secret)
}

/// How long a payout takes: a bank transfer, slower than a client waits.
const PAYOUT_TAKES: std::time::Duration = std::time::Duration::from_secs(3);

/// The application's state.
#[derive(Clone)]
pub struct App {
    pub idem: Idem,
    pub db: Db,
    pub hold: Option<Arc<Hold>>,
}

impl App {
    /// Opens the SQLite file at `path` (created if missing).
    pub async fn sqlite(path: &str) -> Result<App, Box<dyn std::error::Error>> {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let pool = sqlx::SqlitePool::connect_with(opts).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS payments (
                id INTEGER PRIMARY KEY AUTOINCREMENT, principal TEXT NOT NULL,
                amount_cents INTEGER NOT NULL, currency TEXT NOT NULL,
                effect_key TEXT NOT NULL UNIQUE)",
        )
        .execute(&pool)
        .await?;
        let idem = idem_builder().pool(pool.clone()).await?;
        Ok(App {
            idem,
            db: Db::Sqlite(pool),
            hold: None,
        })
    }

    /// Connects to PostgreSQL at `url`.
    #[cfg(feature = "postgres")]
    pub async fn postgres(url: &str) -> Result<App, Box<dyn std::error::Error>> {
        let pool = sqlx::PgPool::connect(url).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS payments (
                id BIGSERIAL PRIMARY KEY, principal TEXT NOT NULL,
                amount_cents BIGINT NOT NULL, currency TEXT NOT NULL,
                effect_key TEXT NOT NULL UNIQUE)",
        )
        .execute(&pool)
        .await?;
        let idem = idem_builder().pool(pool.clone()).await?;
        Ok(App {
            idem,
            db: Db::Postgres(pool),
            hold: None,
        })
    }

    /// The number of payments `principal` has made: the effects, counted from outside.
    pub async fn payments_of(&self, principal: &str) -> Result<i64, sqlx::Error> {
        let sql = "SELECT count(*) FROM payments WHERE principal = $1";
        match &self.db {
            Db::Sqlite(p) => sqlx::query_scalar(sql).bind(principal).fetch_one(p).await,
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => sqlx::query_scalar(sql).bind(principal).fetch_one(p).await,
        }
    }
}

type Row = (i64, i64, String);

/// Checks and writes one payment; the one piece of business logic, shared by both styles.
async fn make_payment(
    app: &App,
    principal: &Principal,
    req: NewPayment,
) -> Result<Payment, ApiError> {
    if req.amount_cents <= 0 {
        return Err(ApiError::Invalid {
            reason: "amount_cents must be positive".into(),
        });
    }
    if req.currency.len() != 3 || !req.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ApiError::Invalid {
            reason: "currency must be an ISO 4217 code such as EUR".into(),
        });
    }
    if req.amount_cents > 1_000_000 {
        return Err(ApiError::Declined {
            reason: "over the single-payment limit of 10000.00".into(),
        });
    }
    if let Some(hold) = &app.hold {
        hold.entered.add_permits(1);
        hold.release.acquire().await.expect("never closed").forget();
    }
    // The row is keyed by the operation's downstream key, so even an attempt re-run
    // after a crash between this write and idem's record writes one row.
    let effect_key = idem_runtime::current().downstream_key("payment");
    let insert = "INSERT INTO payments (principal, amount_cents, currency, effect_key)
                  VALUES ($1, $2, $3, $4) ON CONFLICT (effect_key) DO NOTHING";
    let select = "SELECT id, amount_cents, currency FROM payments WHERE effect_key = $1";
    let (id, amount_cents, currency): Row = match &app.db {
        Db::Sqlite(p) => {
            sqlx::query(insert)
                .bind(principal.as_str())
                .bind(req.amount_cents)
                .bind(&req.currency)
                .bind(&effect_key)
                .execute(p)
                .await?;
            sqlx::query_as(select)
                .bind(&effect_key)
                .fetch_one(p)
                .await?
        }
        #[cfg(feature = "postgres")]
        Db::Postgres(p) => {
            sqlx::query(insert)
                .bind(principal.as_str())
                .bind(req.amount_cents)
                .bind(&req.currency)
                .bind(&effect_key)
                .execute(p)
                .await?;
            sqlx::query_as(select)
                .bind(&effect_key)
                .fetch_one(p)
                .await?
        }
    };
    Ok(Payment {
        id,
        amount_cents,
        currency,
    })
}

/// `POST /payments`: at most one payment per (caller, key) within 24 hours.
#[idempotent(store = app.idem, key = key, scope = principal, retain = "24h",
             in_flight = reject, classify = classify)]
async fn create_payment(
    #[idem(skip)] State(app): State<App>,
    #[idem(skip)] principal: Principal,
    #[idem(skip)] key: IdempotencyKey,
    JsonBody(payment): JsonBody<NewPayment>,
) -> Result<Created, ApiError> {
    make_payment(&app, &principal, payment).await.map(Created)
}

/// `POST /layer/payments`: a plain handler; `IdempotencyLayer` does the rest.
async fn create_payment_plain(
    State(app): State<App>,
    principal: Principal,
    JsonBody(payment): JsonBody<NewPayment>,
) -> Result<Created, ApiError> {
    make_payment(&app, &principal, payment).await.map(Created)
}

/// `POST /layer/payouts`: a payment that takes longer than a client waits. The layer
/// answers `202` with a status URL after a second and the payout runs on.
async fn create_payout(
    State(app): State<App>,
    principal: Principal,
    JsonBody(payment): JsonBody<NewPayment>,
) -> Result<Created, ApiError> {
    tokio::time::sleep(PAYOUT_TAKES).await;
    make_payment(&app, &principal, payment).await.map(Created)
}

/// `GET /payments/{id}`: the caller's own payments only.
async fn get_payment(
    State(app): State<App>,
    principal: Principal,
    Path(id): Path<i64>,
) -> Result<Json<Payment>, ApiError> {
    let sql = "SELECT id, amount_cents, currency FROM payments WHERE id = $1 AND principal = $2";
    let row: Option<Row> = match &app.db {
        Db::Sqlite(p) => {
            sqlx::query_as(sql)
                .bind(id)
                .bind(principal.as_str())
                .fetch_optional(p)
                .await?
        }
        #[cfg(feature = "postgres")]
        Db::Postgres(p) => {
            sqlx::query_as(sql)
                .bind(id)
                .bind(principal.as_str())
                .fetch_optional(p)
                .await?
        }
    };
    let (id, amount_cents, currency) = row.ok_or(ApiError::NotFound)?;
    Ok(Json(Payment {
        id,
        amount_cents,
        currency,
    }))
}

/// A toy authentication layer: `Authorization: Bearer <name>` makes `<name>` the
/// principal; no credentials is a 401.
async fn auth(mut req: Request, next: Next) -> Response {
    let name = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|name| !name.is_empty());
    let Some(name) = name else {
        let problem = Problem::new(
            StatusCode::UNAUTHORIZED,
            "https://payments.example/problems/unauthenticated",
            "Authentication required",
        )
        .detail("send `Authorization: Bearer <name>`");
        return ([(header::WWW_AUTHENTICATE, "Bearer")], problem).into_response();
    };
    let principal = Principal::new(name);
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// The whole API: `/payments` (attribute style) and `/layer/payments` (layer style).
pub fn router(app: App) -> Router {
    let attribute = Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{id}", get(get_payment))
        .layer(IdempotentHandlerLayer::new());
    let layered = Router::new()
        .route("/payments", post(create_payment_plain))
        .route("/payments/{id}", get(get_payment))
        // Named per route by default (`POST /layer/payments`, the nest prefix included),
        // so a key used on another route never replays this one's response.
        .route_layer(IdempotencyLayer::new(app.idem.clone()));
    // Payouts outlive a request: answered 202, their status at `/operations/{token}`.
    let payouts = Router::new()
        .route("/payouts", post(create_payout))
        .route_layer(
            IdempotencyLayer::new(app.idem.clone())
                .accept_after(std::time::Duration::from_secs(1))
                .status_path("/operations"),
        );
    Router::new()
        .merge(attribute)
        .nest("/layer", layered.merge(payouts))
        .nest("/operations", status_routes(&app.idem))
        .layer(middleware::from_fn(auth))
        .with_state(app)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut addr: SocketAddr = "127.0.0.1:3000".parse()?;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.next().ok_or("--addr needs a value")?.parse()?,
            other => return Err(format!("unknown argument `{other}`; expected --addr").into()),
        }
    }
    // idem's problems under this API's base, so clients see one family of `type`s.
    idem_runtime::http::set_type_base(PROBLEM_BASE)?;
    let app = match std::env::var("IDEM_POSTGRES_URL") {
        #[cfg(feature = "postgres")]
        Ok(url) => App::postgres(&url).await?,
        #[cfg(not(feature = "postgres"))]
        Ok(_) => {
            return Err("IDEM_POSTGRES_URL is set but this build has no `postgres` feature".into());
        }
        Err(_) => {
            let path =
                std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "./http_payments.db".into());
            App::sqlite(&path).await?
        }
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("payments API on http://{}", listener.local_addr()?);
    axum::serve(listener, router(app)).await?;
    Ok(())
}
