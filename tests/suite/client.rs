//! Calling other services (`idem_runtime::client`, `queue::message_id`) through real
//! parts: service A is an idempotent body in a process of its own
//! (`tests/bin/client_worker.rs`), idem in A's PostgreSQL schema; service B is axum
//! with `IdempotencyLayer`, idem in B's schema, its effect a row of its `charges`
//! table. A calls B through a fault proxy (`tests/common/proxy.rs`) that drops B's
//! first answer, through the tower layer (under tower's retry) or reqwest-middleware
//! (with reqwest-retry); A is SIGKILLed after B's effect and before A records, then run
//! again. Without the key A's client sends, B would make its effect on every attempt.
#![cfg(feature = "postgres")]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::http::{IdempotencyLayer, Principal};
use idem_runtime::{Idem, InFlight, State as RecordState};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::common::{drop_schema, postgres_skip, postgres_url, unique_table};
use crate::proxy::{Mode, Proxy};
use crate::worker::{Worker, field, last_result_per_key};

/// Service A (`tests/bin/client_worker.rs`).
const WORKER: &str = env!("CARGO_BIN_EXE_idem-client-worker");
/// A's idem table, in A's schema.
const A_TABLE: &str = "idem_a";

/// `url` with `search_path` set to `schema`.
fn in_schema(schema: &str) -> String {
    let base = postgres_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}options=-c%20search_path%3D{schema}")
}

#[derive(Deserialize)]
struct ChargeRequest {
    amount_cents: i64,
}

#[derive(Serialize)]
struct Charge {
    id: i64,
    amount_cents: i64,
}

/// Service B: `POST /charges` inserts a row (its effect) and answers 201 with it, behind
/// `IdempotencyLayer`; every request's `Idempotency-Key` is logged before anything runs.
struct ServiceB {
    addr: SocketAddr,
    pool: PgPool,
    seen: Arc<Mutex<Vec<Option<String>>>>,
}

impl ServiceB {
    async fn start(schema: &str) -> ServiceB {
        let url = in_schema(schema);
        let pool = PgPool::connect(&url).await.unwrap();
        sqlx::query(
            "CREATE TABLE charges (id BIGSERIAL PRIMARY KEY, idem_key TEXT, \
             amount_cents BIGINT NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let idem = Idem::builder()
            .replay_cache_bytes(0)
            .postgres(&url)
            .await
            .unwrap();
        let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
        let app = Router::new()
            .route("/charges", post(create))
            .route_layer(
                IdempotencyLayer::new(idem)
                    // A request without a key runs, unprotected: a client that sends
                    // none shows as a second effect rather than as a 400.
                    .require_key(false)
                    .in_flight(InFlight::Wait(Duration::from_secs(30))),
            )
            .layer(middleware::from_fn(auth))
            .layer(middleware::from_fn_with_state(seen.clone(), log))
            .with_state(pool.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        ServiceB { addr, pool, seen }
    }

    /// Every request's key, in arrival order (retries and replays included).
    fn seen(&self) -> Vec<Option<String>> {
        self.seen.lock().unwrap().clone()
    }

    /// B's effects: `(id, key)` per row, oldest first.
    async fn charges(&self) -> Vec<(i64, Option<String>)> {
        sqlx::query_as("SELECT id, idem_key FROM charges ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

async fn create(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<(StatusCode, Json<Charge>), StatusCode> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let (id,): (i64,) =
        sqlx::query_as("INSERT INTO charges (idem_key, amount_cents) VALUES ($1, $2) RETURNING id")
            .bind(key)
            .bind(req.amount_cents)
            .fetch_one(&pool)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let charge = Charge {
        id,
        amount_cents: req.amount_cents,
    };
    Ok((StatusCode::CREATED, Json(charge)))
}

/// Every caller is service A.
async fn auth(mut req: Request, next: Next) -> Response {
    req.extensions_mut().insert(Principal::new("service-a"));
    next.run(req).await
}

async fn log(
    State(seen): State<Arc<Mutex<Vec<Option<String>>>>>,
    req: Request,
    next: Next,
) -> Response {
    let key = req.headers().get("idempotency-key");
    let key = key.and_then(|v| v.to_str().ok()).map(str::to_owned);
    seen.lock().unwrap().push(key);
    next.run(req).await
}

/// A's and B's schemas, B running, and the proxy A reaches B through.
struct Services {
    admin: PgPool,
    schemas: [String; 2],
    b: ServiceB,
    proxy: Proxy,
}

impl Services {
    async fn start(test: &str) -> Option<Services> {
        if postgres_skip(test).is_some() {
            return None;
        }
        let admin = PgPool::connect(&postgres_url()).await.unwrap();
        let schemas = [
            unique_table(&format!("{test}_a")),
            unique_table(&format!("{test}_b")),
        ];
        for s in &schemas {
            sqlx::query(&format!("CREATE SCHEMA {s}"))
                .execute(&admin)
                .await
                .unwrap();
        }
        let b = ServiceB::start(&schemas[1]).await;
        let proxy = Proxy::start(&b.addr.to_string()).await;
        Some(Services {
            admin,
            schemas,
            b,
            proxy,
        })
    }

    /// Service A on `keys`, reaching B through the proxy.
    fn a(&self, keys: &[&str], extra: &[&str]) -> Worker {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let b = format!("http://127.0.0.1:{}", self.proxy.port);
        Worker::spawn_at(
            WORKER,
            &in_schema(&self.schemas[0]),
            A_TABLE,
            &b,
            &keys,
            extra,
        )
    }

    /// A handle on A's records.
    async fn a_idem(&self) -> Idem {
        Idem::builder()
            .table(A_TABLE)
            .replay_cache_bytes(0)
            .postgres(&in_schema(&self.schemas[0]))
            .await
            .unwrap()
    }

    /// The key A's operation `order` on `key` sends for `label`.
    async fn key(&self, key: &str, label: &str) -> String {
        let a = self.a_idem().await;
        a.operation("order", key).id().downstream_key(label)
    }

    /// Whether A's operation on `key` is recorded.
    async fn a_state(&self, key: &str) -> RecordState {
        let a = self.a_idem().await;
        let record = a.get(a.operation("order", key).id()).await.unwrap();
        record.expect("A's record").info.state
    }

    async fn cleanup(self) {
        for s in &self.schemas {
            drop_schema(&self.admin, s).await;
        }
    }
}

/// A's body calls B once through `client`; B's first answer is dropped (A's client
/// retries), A is killed once it has B's answer, and run again.
async fn killed_after_bs_effect_then_retried(test: &str, client: &str) {
    let Some(s) = Services::start(test).await else {
        return;
    };
    s.proxy.set(Mode::ResetNextReply);
    let mut a = s.a(
        &["order-1"],
        &["--client", client, "--pause-at", "after-call"],
    );
    a.until("paused", 1).await;
    assert_eq!(s.proxy.mode(), Mode::Pass, "B's first answer was dropped");
    assert_eq!(s.b.seen().len(), 2, "A's client retried the dropped answer");
    a.kill9().await;
    assert_eq!(
        s.b.charges().await.len(),
        1,
        "B's effect, before A is retried"
    );

    let done = last_result_per_key(&s.a(&["order-1"], &["--client", client]).output().await);
    let line = &done["order-1"];
    assert!(line.starts_with("done order-1"), "{line}");
    let charges = s.b.charges().await;
    assert_eq!(charges.len(), 1, "B's effect happened once: {charges:?}");
    assert_eq!(
        field(line, "charges"),
        charges[0].0.to_string(),
        "A's outcome is B's charge"
    );
    assert_eq!(
        field(line, "b_replayed"),
        "true",
        "B answered A's re-run with the response it recorded"
    );
    assert_eq!(s.a_state("order-1").await, RecordState::Completed);
    let key = s.key("order-1", "POST /charges#0").await;
    assert_eq!(charges[0].1.as_ref(), Some(&key));
    assert_eq!(
        s.b.seen(),
        vec![Some(key); 3],
        "one key on every attempt and run"
    );
    s.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tower_layer_a_killed_after_bs_effect_then_retried_one_effect_bs_outcome() {
    killed_after_bs_effect_then_retried("client_tower_kill9", "tower").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_middleware_a_killed_after_bs_effect_then_retried_one_effect_bs_outcome() {
    killed_after_bs_effect_then_retried("client_reqwest_kill9", "reqwest").await;
}

/// The middleware attached after the retry middleware rather than before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_middleware_after_the_retry_a_killed_then_retried_one_effect() {
    killed_after_bs_effect_then_retried("client_retry_first_kill9", "reqwest-retry-first").await;
}

/// Two steps, each a call to B's one endpoint; A is killed inside the second step once
/// B answered it, and run again: the first step replays, the second calls B again.
async fn two_steps_killed_in_the_second(test: &str, client: &str) {
    let Some(s) = Services::start(test).await else {
        return;
    };
    s.proxy.set(Mode::ResetNextReply);
    let body = ["--client", client, "--body", "two-steps"];
    let mut a = s.a(
        &["order-2"],
        &[&body[..], &["--pause-at", "in-second-step"]].concat(),
    );
    a.until("paused", 1).await;
    a.kill9().await;
    let done = last_result_per_key(&s.a(&["order-2"], &body).output().await);
    let line = &done["order-2"];
    assert!(line.starts_with("done order-2"), "{line}");

    let charges = s.b.charges().await;
    let (first, second) = (
        s.key("order-2", "first").await,
        s.key("order-2", "second").await,
    );
    let rows: Vec<Option<&String>> = charges.iter().map(|c| c.1.as_ref()).collect();
    assert_eq!(
        rows,
        [Some(&first), Some(&second)],
        "two effects, each once"
    );
    let ids = format!("{},{}", charges[0].0, charges[1].0);
    assert_eq!(
        field(line, "charges"),
        ids,
        "each step's outcome is its own charge"
    );
    assert!(field(line, "b_replayed").ends_with(",true"), "{line}");
    assert_eq!(s.a_state("order-2").await, RecordState::Completed);
    // The first call's dropped answer was retried; the second step's call was
    // made again by the re-run.
    let seen = s.b.seen();
    let expected = [&first, &first, &second, &second].map(|k| Some(k.clone()));
    assert_eq!(seen, expected);
    s.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tower_layer_two_steps_two_calls_to_one_endpoint_two_effects_each_once() {
    two_steps_killed_in_the_second("client_tower_steps", "tower").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_middleware_two_steps_two_calls_to_one_endpoint_two_effects_each_once() {
    two_steps_killed_in_the_second("client_reqwest_steps", "reqwest").await;
}

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// JetStream, or `None` after a line saying why (a failure under `IDEM_REQUIRE_DB=1`).
async fn jetstream(test: &str) -> Option<async_nats::jetstream::Context> {
    match async_nats::connect(nats_url()).await {
        Ok(client) => Some(async_nats::jetstream::new(client)),
        Err(e) if crate::common::db_required() => panic!(
            "NATS is required (IDEM_REQUIRE_DB=1) but {} is not reachable: {e}",
            nats_url()
        ),
        Err(e) => {
            crate::common::skip(test, &format!("NATS not reachable at {} ({e})", nats_url()));
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_killed_after_its_publish_and_retried_leaves_one_message() {
    let test = "client_publish";
    let Some(js) = jetstream(test).await else {
        return;
    };
    let Some(s) = Services::start(test).await else {
        return;
    };
    let unique = unique_table(test).to_uppercase();
    let (stream, subject) = (unique.clone(), format!("idem.{unique}"));
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    let nats = nats_url();
    let body = ["--body", "publish", "--nats", &nats, "--subject", &subject];
    let mut a = s.a(
        &["order-3"],
        &[&body[..], &["--pause-at", "after-call"]].concat(),
    );
    a.until("paused", 1).await;
    a.kill9().await;
    let done = last_result_per_key(&s.a(&["order-3"], &body).output().await);
    let line = &done["order-3"];
    assert!(line.starts_with("done order-3"), "{line}");
    assert_eq!(
        field(line, "duplicate"),
        "true",
        "the re-run's publish was dropped"
    );

    let mut info = js.get_stream(&stream).await.unwrap();
    let messages = info.info().await.unwrap().state.messages;
    assert_eq!(messages, 1, "one message in the stream");
    assert_eq!(field(line, "seq"), "1");
    assert_eq!(s.a_state("order-3").await, RecordState::Completed);
    js.delete_stream(&stream).await.unwrap();
    s.cleanup().await;
}
