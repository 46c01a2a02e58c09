//! HTTP: the example's payments API (`examples/http_payments.rs`) served on 127.0.0.1
//! and driven over TCP by a real client. Every behaviour test runs twice: against the
//! `#[idempotent]` handler (`/payments`) and against `IdempotencyLayer`
//! (`/layer/payments`), each on SQLite and on PostgreSQL (skipped, with a line saying
//! so, when PostgreSQL is not reachable; `IDEM_REQUIRE_DB=1` makes that a failure).

#[allow(dead_code)]
#[path = "../../examples/http_payments.rs"]
mod http_payments;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_payments::{App, Db, Hold, Payment};
use idem_runtime::http::{IdempotencyKey, KeyRejection, types};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Barrier, Semaphore};

use crate::common;
#[allow(dead_code)]
use crate::proxy;

#[derive(Clone, Copy, Debug)]
enum Style {
    Attribute,
    Layer,
}

/// Where the example's data lives: a SQLite file, or a PostgreSQL schema of the
/// test's own (through `search_path`, so the example's fixed table names are unique).
#[derive(Clone, Debug)]
enum Backend {
    Sqlite,
    #[cfg(feature = "postgres")]
    Postgres {
        url: String,
    },
}

/// One instance of a behaviour test: a style on a backend.
#[derive(Clone, Debug)]
struct Case {
    style: Style,
    backend: Backend,
}

impl Case {
    fn sqlite(style: Style) -> Case {
        Case {
            style,
            backend: Backend::Sqlite,
        }
    }

    /// A fresh schema, or `None` (with a line saying why) without PostgreSQL.
    #[cfg(feature = "postgres")]
    async fn postgres(style: Style, test: &str) -> Option<(Case, String)> {
        if common::postgres_skip(test).is_some() {
            return None;
        }
        let schema = common::unique_table(&format!("http_{test}"));
        let admin = sqlx::PgPool::connect(&common::postgres_url())
            .await
            .unwrap();
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .unwrap();
        let base = common::postgres_url();
        let sep = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{sep}options=-c%20search_path%3D{schema}");
        Some((
            Case {
                style,
                backend: Backend::Postgres { url },
            },
            schema,
        ))
    }
}

/// Every behaviour test once per style and backend, each on a server and database of
/// its own.
macro_rules! http_suite {
    ($($name:ident),* $(,)?) => {
        http_suite!(@style attribute Attribute ($($name),*));
        http_suite!(@style layer Layer ($($name),*));
    };
    (@style $module:ident $style:ident ($($name:ident),*)) => {
        mod $module {
            mod sqlite {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    async fn $name() {
                        let case = crate::http::Case::sqlite(crate::http::Style::$style);
                        crate::http::$name(case).await
                    }
                )*
            }
            #[cfg(feature = "postgres")]
            mod postgres {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                    async fn $name() {
                        let style = crate::http::Style::$style;
                        let Some((case, schema)) = crate::http::Case::postgres(style, stringify!($name)).await
                        else {
                            return;
                        };
                        crate::http::$name(case).await;
                        let admin = sqlx::PgPool::connect(&crate::common::postgres_url()).await.unwrap();
                        crate::common::drop_schema(&admin, &schema).await;
                    }
                )*
            }
        }
    };
}

http_suite!(
    first_call_creates_and_retry_replays,
    recorded_error_is_replayed,
    quoted_and_bare_key_are_one_key,
    bad_keys_are_400,
    key_reused_with_another_payload_is_422,
    an_unreadable_body_is_a_problem_and_leaves_the_key_free,
    in_flight_is_409_with_retry_after,
    store_down_is_503_and_nothing_runs,
    unknown_outcome_is_500_and_superseded_attempt_is_500,
    hundred_concurrent_posts_make_one_payment,
    two_principals_one_key_are_independent,
    client_disconnect_then_retry_replays,
);

/// A running server on the example's router.
struct Server {
    case: Case,
    base: String,
    app: App,
    hold: Arc<Hold>,
    /// One permit per server-side connection that has closed.
    closed: Arc<Semaphore>,
    client: reqwest::Client,
    dir: tempfile::TempDir,
}

impl Server {
    async fn start(case: Case, hold: bool) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut app = open(&case, &dir).await;
        let held = Arc::new(Hold::default());
        if hold {
            app.hold = Some(held.clone());
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let closed = Arc::new(Semaphore::new(0));
        let tracked = Tracked {
            listener,
            closed: closed.clone(),
        };
        let router = http_payments::router(app.clone());
        tokio::spawn(async move { axum::serve(tracked, router).await.unwrap() });
        Server {
            case,
            base,
            app,
            hold: held,
            closed,
            client: reqwest::Client::new(),
            dir,
        }
    }

    fn url(&self, tail: &str) -> String {
        match self.case.style {
            Style::Attribute => format!("{}/payments{tail}", self.base),
            Style::Layer => format!("{}/layer/payments{tail}", self.base),
        }
    }

    /// `POST /payments` as `who` with `key` (a raw header value) and `body`.
    async fn post(&self, who: &str, key: Option<&[u8]>, body: &Value) -> Reply {
        let mut req = self.client.post(self.url("")).bearer_auth(who).json(body);
        if let Some(key) = key {
            req = req.header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            );
        }
        Reply::read(req.send().await.expect("request")).await
    }

    async fn payments_of(&self, who: &str) -> i64 {
        self.app.payments_of(who).await.expect("count")
    }

    /// Runs `sql` on the example's database, returning the rows it changed.
    async fn execute(&self, sql: &str) -> u64 {
        match &self.app.db {
            Db::Sqlite(p) => sqlx::query(sql).execute(p).await.unwrap().rows_affected(),
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => sqlx::query(sql).execute(p).await.unwrap().rows_affected(),
        }
    }

    /// Closes the example's pool: its store and its payments are down.
    async fn take_store_down(&self) {
        match &self.app.db {
            Db::Sqlite(p) => p.close().await,
            #[cfg(feature = "postgres")]
            Db::Postgres(p) => p.close().await,
        }
    }
}

async fn open(case: &Case, dir: &tempfile::TempDir) -> App {
    match &case.backend {
        Backend::Sqlite => {
            let db = dir.path().join("payments.db");
            App::sqlite(db.to_str().unwrap()).await.expect("open")
        }
        #[cfg(feature = "postgres")]
        Backend::Postgres { url } => App::postgres(url).await.expect("open"),
    }
}

fn pay(cents: i64) -> Value {
    json!({"amount_cents": cents, "currency": "EUR"})
}

/// A response, read in full.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Reply {
    async fn read(res: reqwest::Response) -> Reply {
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res.bytes().await.expect("body");
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn payment(&self) -> Payment {
        assert_eq!(self.status, StatusCode::CREATED, "{self:?}");
        serde_json::from_value(self.body.clone()).expect("a payment")
    }

    /// Asserts a problem+json body of `type_uri` with a matching `status` member.
    /// A problem of idem's own `kind` (one of `types`).
    fn assert_problem(&self, status: StatusCode, kind: &str) {
        self.assert_problem_uri(status, &idem_runtime::http::type_uri(kind));
    }

    fn assert_problem_uri(&self, status: StatusCode, type_uri: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        assert_eq!(self.body["type"], type_uri, "{self:?}");
        assert_eq!(self.body["status"], status.as_u16(), "{self:?}");
        assert!(self.body["title"].is_string(), "{self:?}");
    }

    fn retry_after(&self) -> u64 {
        let secs: u64 = self
            .header("retry-after")
            .unwrap_or_else(|| panic!("no Retry-After: {self:?}"))
            .parse()
            .expect("Retry-After in seconds");
        // Whole seconds, rounded up, within the 60-second lease that is running.
        assert!((1..=60).contains(&secs), "{self:?}");
        secs
    }
}

async fn first_call_creates_and_retry_replays(case: Case) {
    let s = Server::start(case, false).await;
    let first = s.post("alice", Some(b"\"k-1\""), &pay(1999)).await;
    let payment = first.payment();
    assert_eq!(
        (payment.amount_cents, payment.currency.as_str()),
        (1999, "EUR")
    );
    assert!(!first.replayed(), "{first:?}");
    let retry = s.post("alice", Some(b"\"k-1\""), &pay(1999)).await;
    assert_eq!(retry.payment(), payment);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(s.payments_of("alice").await, 1);
    // GET is not idempotency-keyed and reads the caller's own payments only.
    let own = s
        .client
        .get(s.url(&format!("/{}", payment.id)))
        .bearer_auth("alice")
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), StatusCode::OK);
    assert!(own.headers().get("idempotent-replayed").is_none());
    assert_eq!(own.json::<Payment>().await.unwrap(), payment);
    let other = s
        .client
        .get(s.url(&format!("/{}", payment.id)))
        .bearer_auth("mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND);
}

async fn recorded_error_is_replayed(case: Case) {
    let s = Server::start(case, false).await;
    let declined = s.post("alice", Some(b"big"), &pay(2_000_000)).await;
    declined.assert_problem_uri(
        StatusCode::PAYMENT_REQUIRED,
        "https://payments.example/problems/declined",
    );
    assert!(!declined.replayed(), "{declined:?}");
    let again = s.post("alice", Some(b"big"), &pay(2_000_000)).await;
    again.assert_problem_uri(
        StatusCode::PAYMENT_REQUIRED,
        "https://payments.example/problems/declined",
    );
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, declined.body);
    assert_eq!(s.payments_of("alice").await, 0);
}

async fn quoted_and_bare_key_are_one_key(case: Case) {
    let s = Server::start(case, false).await;
    let quoted = s.post("alice", Some(b"\"8e03-40d5\""), &pay(500)).await;
    let bare = s.post("alice", Some(b"8e03-40d5"), &pay(500)).await;
    assert_eq!(bare.payment(), quoted.payment());
    assert!(bare.replayed(), "{bare:?}");
    // Another key with the same payload is another payment.
    let other = s.post("alice", Some(b"8e03-40d6"), &pay(500)).await;
    assert_ne!(other.payment().id, quoted.payment().id);
    assert_eq!(s.payments_of("alice").await, 2);
}

async fn bad_keys_are_400(case: Case) {
    let s = Server::start(case, false).await;
    let long = "k".repeat(256);
    let cases: [(Option<&[u8]>, &str); 7] = [
        (None, KeyRejection::Missing.rule()),
        (Some(b""), KeyRejection::Empty.rule()),
        (Some(b"\"\""), KeyRejection::Empty.rule()),
        (Some(b"\"unterminated"), KeyRejection::Malformed.rule()),
        (Some(b"two words"), KeyRejection::Malformed.rule()),
        (Some(b"caf\xe9"), KeyRejection::NotAscii.rule()),
        (
            Some(long.as_bytes()),
            KeyRejection::TooLong { len: 256 }.rule(),
        ),
    ];
    for (key, rule) in cases {
        let r = s.post("alice", key, &pay(100)).await;
        r.assert_problem(StatusCode::BAD_REQUEST, types::INVALID_KEY);
        assert_eq!(r.body["header"], "Idempotency-Key", "{r:?}");
        assert_eq!(r.body["rule"], rule, "{key:?}: {r:?}");
        assert!(r.body["detail"].is_string(), "{r:?}");
    }
    // The header twice is refused too, whatever the values.
    let r = Reply::read(
        s.client
            .post(s.url(""))
            .bearer_auth("alice")
            .header("idempotency-key", "a")
            .header("idempotency-key", "a")
            .json(&pay(100))
            .send()
            .await
            .unwrap(),
    )
    .await;
    r.assert_problem(StatusCode::BAD_REQUEST, types::INVALID_KEY);
    assert_eq!(r.body["rule"], KeyRejection::Repeated.rule());
    // 255 characters is within the cap.
    let max = "k".repeat(255);
    s.post("alice", Some(max.as_bytes()), &pay(100))
        .await
        .payment();
    assert_eq!(s.payments_of("alice").await, 1);
}

/// A body the API cannot read is the example's own problem+json, under the same media
/// type as idem's; it is a refusal before anything ran, so the corrected retry with
/// the same key runs and is not a replay.
async fn an_unreadable_body_is_a_problem_and_leaves_the_key_free(case: Case) {
    let s = Server::start(case, false).await;
    let malformed = s
        .client
        .post(s.url(""))
        .bearer_auth("alice")
        .header("idempotency-key", "k")
        .header("content-type", "application/json")
        .body(r#"{"amount_cents": 100, "currency": "EUR""#)
        .send()
        .await
        .unwrap();
    let r = Reply::read(malformed).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(
        r.body["type"],
        format!("{}unreadable-body", http_payments::PROBLEM_BASE)
    );
    assert!(
        r.body["detail"].as_str().is_some_and(|d| !d.is_empty()),
        "{r:?}"
    );
    let corrected = s.post("alice", Some(b"k"), &pay(100)).await;
    assert!(!corrected.replayed());
    corrected.payment();
    assert_eq!(s.payments_of("alice").await, 1);
}

async fn key_reused_with_another_payload_is_422(case: Case) {
    let s = Server::start(case, false).await;
    s.post("alice", Some(b"k"), &pay(100)).await.payment();
    let r = s.post("alice", Some(b"k"), &pay(200)).await;
    r.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    // No base was set: the type names no web domain.
    assert_eq!(r.body["type"], "urn:idem:problem:key-reused");
    assert!(!r.replayed());
    assert_eq!(s.payments_of("alice").await, 1);
}

async fn in_flight_is_409_with_retry_after(case: Case) {
    let s = Arc::new(Server::start(case, true).await);
    let first = tokio::spawn({
        let s = s.clone();
        async move { s.post("alice", Some(b"slow"), &pay(100)).await }
    });
    s.hold.entered.acquire().await.unwrap().forget();
    let dup = s.post("alice", Some(b"slow"), &pay(100)).await;
    dup.assert_problem(StatusCode::CONFLICT, types::IN_FLIGHT);
    assert_eq!(dup.body["retry_after"], dup.retry_after());
    s.hold.release.add_permits(1);
    let payment = first.await.unwrap().payment();
    let retry = s.post("alice", Some(b"slow"), &pay(100)).await;
    assert_eq!(retry.payment(), payment);
    assert!(retry.replayed());
    assert_eq!(s.payments_of("alice").await, 1);
}

async fn store_down_is_503_and_nothing_runs(case: Case) {
    let s = Server::start(case, false).await;
    s.take_store_down().await;
    let r = s.post("alice", Some(b"k"), &pay(100)).await;
    r.assert_problem(StatusCode::SERVICE_UNAVAILABLE, types::STORE_UNAVAILABLE);
    r.retry_after();
    // Counted through a new pool on the same database: the body did not run.
    let count = open(&s.case, &s.dir).await;
    assert_eq!(count.payments_of("alice").await.unwrap(), 0);
}

async fn unknown_outcome_is_500_and_superseded_attempt_is_500(case: Case) {
    let s = Arc::new(Server::start(case, true).await);
    let first = tokio::spawn({
        let s = s.clone();
        async move { s.post("alice", Some(b"k"), &pay(100)).await }
    });
    s.hold.entered.acquire().await.unwrap().forget();
    // What a takeover with `on_takeover = unknown` leaves behind: the running claim is
    // parked in UNKNOWN (state 2 of the documented schema) for reconciliation.
    let parked = s
        .execute("UPDATE idem_operations SET state = 2 WHERE state = 0")
        .await;
    assert_eq!(parked, 1);
    let retry = s.post("alice", Some(b"k"), &pay(100)).await;
    retry.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, types::OUTCOME_UNKNOWN);
    assert!(!retry.replayed());
    // The attempt that lost its claim cannot record its outcome.
    s.hold.release.add_permits(1);
    let first = first.await.unwrap();
    first.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, types::SUPERSEDED);
}

async fn hundred_concurrent_posts_make_one_payment(case: Case) {
    let s = Arc::new(Server::start(case, false).await);
    let barrier = Arc::new(Barrier::new(100));
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let (s, barrier) = (s.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                s.post("alice", Some(b"\"same\""), &pay(4200)).await
            })
        })
        .collect();
    let mut payments = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        if r.status == StatusCode::CONFLICT {
            r.assert_problem(StatusCode::CONFLICT, types::IN_FLIGHT);
            r.retry_after();
        } else {
            payments.push(r.payment());
        }
    }
    assert!(!payments.is_empty());
    assert!(payments.iter().all(|p| *p == payments[0]), "{payments:?}");
    assert_eq!(s.payments_of("alice").await, 1);
}

async fn two_principals_one_key_are_independent(case: Case) {
    let s = Server::start(case, false).await;
    let alice = s.post("alice", Some(b"shared"), &pay(100)).await.payment();
    let bob = s.post("bob", Some(b"shared"), &pay(100)).await;
    assert!(!bob.replayed(), "{bob:?}");
    let bob = bob.payment();
    assert_ne!(alice.id, bob.id);
    // Each retry replays the caller's own payment; a payload alice's key never saw is
    // fine for bob, whose key is his own.
    let again = s.post("bob", Some(b"shared"), &pay(100)).await;
    assert_eq!(again.payment(), bob);
    s.post("bob", Some(b"other"), &pay(999)).await.payment();
    let alice_again = s.post("alice", Some(b"shared"), &pay(100)).await;
    assert_eq!(alice_again.payment(), alice);
    assert_eq!(s.payments_of("alice").await, 1);
    assert_eq!(s.payments_of("bob").await, 2);
}

async fn client_disconnect_then_retry_replays(case: Case) {
    let s = Arc::new(Server::start(case, true).await);
    let gone = tokio::spawn({
        let s = s.clone();
        async move { s.post("alice", Some(b"k"), &pay(100)).await }
    });
    s.hold.entered.acquire().await.unwrap().forget();
    // The client goes away mid-request; wait until the server has seen its connection
    // close (axum drops the request's future then), and only then let the body go on.
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    s.closed.acquire().await.unwrap().forget();
    s.hold.release.add_permits(1);
    // The retry replays once the body has finished; until then it is told to wait.
    let replay = loop {
        let r = s.post("alice", Some(b"k"), &pay(100)).await;
        if r.status != StatusCode::CONFLICT {
            break r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    replay.payment();
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(s.payments_of("alice").await, 1);
}

/// The layer's own refusals: a body over its cap, and a route with no principal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_refuses_oversized_bodies_and_requests_without_principal() {
    let s = Server::start(Case::sqlite(Style::Layer), false).await;
    let big = json!({"amount_cents": 100, "currency": "EUR", "pad": "x".repeat(1 << 20)});
    let r = s.post("alice", Some(b"k"), &big).await;
    r.assert_problem(StatusCode::PAYLOAD_TOO_LARGE, types::BODY_TOO_LARGE);
    assert_eq!(s.payments_of("alice").await, 0);

    // No auth layer in front: the layer refuses rather than run under a shared scope.
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let router = axum::Router::new()
        .route(
            "/x",
            axum::routing::post({
                let runs = runs.clone();
                move || async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    "ran"
                }
            }),
        )
        .route_layer(idem_runtime::http::IdempotencyLayer::new(
            idem_runtime::Idem::memory(),
        ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/x", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let r = Reply::read(
        reqwest::Client::new()
            .post(&url)
            .header("idempotency-key", "k")
            .send()
            .await
            .unwrap(),
    )
    .await;
    r.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, types::NO_PRINCIPAL);
    // Methods it does not cover pass through untouched, key or no key.
    let r = reqwest::Client::new().put(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// Arbitrary header bytes never panic the parser, and every key it accepts is valid
/// and reads back the same from its structured-field form (and its bare form, where
/// it has one).
#[test]
fn header_parser_never_panics_and_accepted_keys_round_trip() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("IDEM_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("header parser fuzz seed {seed} (IDEM_FUZZ_SEED={seed} reproduces it)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let alphabet = b" \t\"\\;=,:abcXYZ019-_*~()\x7f\x00\xff\xe9";
    let mut accepted = 0;
    for _ in 0..100_000 {
        let len = rng.gen_range(0..300);
        let mut bytes: Vec<u8> = match rng.gen_range(0..3) {
            0 => (0..len).map(|_| rng.r#gen()).collect(),
            1 => (0..len).map(|_| rng.gen_range(0x20..0x7f)).collect(),
            _ => (0..len)
                .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
                .collect(),
        };
        if rng.gen_bool(0.3) {
            bytes.insert(0, b'"');
            if rng.gen_bool(0.7) {
                bytes.push(b'"');
            }
        }
        let shown = bytes.escape_ascii().to_string();
        let parsed = std::panic::catch_unwind(|| IdempotencyKey::parse(&bytes))
            .unwrap_or_else(|_| panic!("seed {seed}: parse panicked on {shown}"));
        if let Ok(header) = reqwest::header::HeaderValue::from_bytes(&bytes) {
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert("idempotency-key", header);
            assert_eq!(
                IdempotencyKey::from_headers(&headers),
                parsed.clone().map(Some),
                "seed {seed}: {shown}"
            );
        }
        let Ok(key) = parsed else { continue };
        accepted += 1;
        let text = key.as_str();
        assert!(
            (1..=255).contains(&text.len()) && text.bytes().all(|b| (0x20..0x7f).contains(&b)),
            "seed {seed}: accepted {text:?} from {shown}"
        );
        let sf = key.to_header_value();
        assert_eq!(
            IdempotencyKey::parse(sf.as_bytes()).as_ref(),
            Ok(&key),
            "seed {seed}: {shown}"
        );
        if !text.contains(' ') && !text.starts_with('"') {
            assert_eq!(
                IdempotencyKey::parse(text.as_bytes()).as_ref(),
                Ok(&key),
                "seed {seed}: {shown}"
            );
        }
    }
    assert!(
        accepted > 1000,
        "seed {seed}: only {accepted} keys accepted"
    );
}

/// A listener that counts closed connections, so a test can wait for the server to
/// have seen a client go away.
struct Tracked {
    listener: TcpListener,
    closed: Arc<Semaphore>,
}

struct TrackedIo {
    stream: TcpStream,
    closed: Arc<Semaphore>,
}

impl Drop for TrackedIo {
    fn drop(&mut self) {
        self.closed.add_permits(1);
    }
}

impl axum::serve::Listener for Tracked {
    type Io = TrackedIo;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (TrackedIo, std::net::SocketAddr) {
        let (stream, addr) = self.listener.accept().await.expect("accept");
        let closed = self.closed.clone();
        (TrackedIo { stream, closed }, addr)
    }

    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Serves `router` on 127.0.0.1 with every request authenticated as `alice`, or as
/// the caller its `x-user` header names.
async fn serve_as_alice(router: axum::Router) -> String {
    let router = router.layer(axum::middleware::from_fn(
        |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            let user = req
                .headers()
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("alice")
                .to_owned();
            req.extensions_mut()
                .insert(idem_runtime::http::Principal::new(user));
            next.run(req).await
        },
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    base
}

/// The layer records what its handlers answer, 5xx included, but passes on a "try
/// again" (429) and a status the application releases, freeing the key (the retry
/// runs); a response over the cap parks the key for reconciliation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_records_5xx_and_releases_what_the_application_marks() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = Arc::new(AtomicUsize::new(0));
    let flaky = |first: StatusCode| {
        let runs = runs.clone();
        move || async move {
            match runs.fetch_add(1, Ordering::SeqCst) {
                0 => (first, "busy"),
                _ => (StatusCode::OK, "done"),
            }
        }
    };
    // A route whose 503 comes only before anything happened, released on purpose.
    let shed = axum::Router::new()
        .route(
            "/shed",
            axum::routing::post(flaky(StatusCode::SERVICE_UNAVAILABLE)),
        )
        .route_layer(
            idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory())
                .release_status(StatusCode::SERVICE_UNAVAILABLE),
        );
    let failed_runs = Arc::new(AtomicUsize::new(0));
    let failed = {
        let runs = failed_runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            (
                StatusCode::BAD_GATEWAY,
                "charged, then the receipt service failed",
            )
        }
    };
    let big_runs = Arc::new(AtomicUsize::new(0));
    let big = {
        let runs = big_runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            "x".repeat(100)
        }
    };
    // "done" with its content-type is 72 bytes as the layer counts it; "x" × 100, 168.
    let router = axum::Router::new()
        .route(
            "/flaky",
            axum::routing::post(flaky(StatusCode::TOO_MANY_REQUESTS)),
        )
        .route("/big", axum::routing::post(big))
        .route("/failed", axum::routing::post(failed))
        .route_layer(
            idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory())
                .name("final")
                .max_response_bytes(150),
        )
        .merge(shed);
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |path: &str| {
        client
            .post(format!("{base}{path}"))
            .header("idempotency-key", "k")
            .send()
    };
    for (path, status) in [
        ("/flaky", StatusCode::TOO_MANY_REQUESTS),
        ("/shed", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        runs.store(0, Ordering::SeqCst);
        let busy = Reply::read(post(path).await.unwrap()).await;
        assert_eq!(busy.status, status, "{path}");
        let done = post(path).await.unwrap();
        assert_eq!(
            done.status(),
            StatusCode::OK,
            "{path}: the released key was held"
        );
        assert!(done.headers().get("idempotent-replayed").is_none());
        assert_eq!(done.text().await.unwrap(), "done");
        let replay = post(path).await.unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.text().await.unwrap(), "done");
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{path}");
    }

    // A 5xx after the handler ran is recorded: the retry gets it, the handler runs once.
    let failed = |key: &'static str| {
        client
            .post(format!("{base}/failed"))
            .header("idempotency-key", key)
            .send()
    };
    let first = failed("f").await.unwrap();
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let retry = failed("f").await.unwrap();
    assert_eq!(retry.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.text().await.unwrap(),
        "charged, then the receipt service failed"
    );
    assert_eq!(
        failed_runs.load(Ordering::SeqCst),
        1,
        "a recorded 5xx ran again"
    );

    // One key under one explicit name, shared by both routes on purpose: the same key
    // on the other route is another request.
    let reused = Reply::read(post("/big").await.unwrap()).await;
    reused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    let big = |key: &'static str| {
        client
            .post(format!("{base}/big"))
            .header("idempotency-key", key)
            .send()
    };
    let first = Reply::read(big("big").await.unwrap()).await;
    first.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, types::OUTCOME_UNKNOWN);
    let again = Reply::read(big("big").await.unwrap()).await;
    again.assert_problem(StatusCode::INTERNAL_SERVER_ERROR, types::OUTCOME_UNKNOWN);
    // It ran once: an effect that may have happened is not run again.
    assert_eq!(big_runs.load(Ordering::SeqCst), 1);
}

/// Serves one route behind `IdempotencyLayer` on a SQLite store with the default
/// outcome cap, answering 201 with `body` and `headers` (`x-note` recorded too), and
/// posts to it twice with one key: the first answer and its replay must both be the
/// route's response byte for byte, the replay marked, and the route run once.
async fn layer_replays_byte_for_byte(body: Vec<u8>, headers: &[(&'static str, &'static [u8])]) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = Arc::new(AtomicUsize::new(0));
    let route = {
        let (runs, body, headers) = (runs.clone(), body.clone(), headers.to_vec());
        axum::routing::post(move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let mut res = axum::response::Response::new(axum::body::Body::from(body));
            *res.status_mut() = StatusCode::CREATED;
            for (name, value) in headers {
                let value = reqwest::header::HeaderValue::from_bytes(value).unwrap();
                res.headers_mut().insert(name, value);
            }
            res
        })
    };
    let idem = idem_runtime::Idem::sqlite("sqlite::memory:").await.unwrap();
    let router = axum::Router::new().route("/r", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem)
            .record_header(reqwest::header::HeaderName::from_static("x-note")),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    for replayed in [false, true] {
        let res = client
            .post(format!("{base}/r"))
            .header("idempotency-key", "k")
            .send()
            .await
            .unwrap();
        let (status, got) = (res.status(), res.headers().clone());
        let bytes = res.bytes().await.unwrap();
        let shown = format!("replayed {replayed}: {status} {got:?}");
        assert_eq!(status, StatusCode::CREATED, "{shown}: {bytes:?}");
        assert!(bytes[..] == body[..], "{shown}: the body differs");
        for (name, value) in headers {
            let got = got.get(*name).map(|v| v.as_bytes());
            assert_eq!(got, Some(*value), "{shown}: header {name}");
        }
        assert_eq!(
            got.get("idempotent-replayed").map(|v| v.as_bytes()),
            replayed.then_some(&b"true"[..]),
            "{shown}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the route ran once");
}

/// 48 KB of JSON full of quotes, over the store's 64 KiB cap once escaped as a string.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_replays_a_48_kb_json_response_byte_for_byte() {
    let json = serde_json::to_vec(&vec!["ab"; 9_599]).unwrap();
    assert!((47_000..=48_000).contains(&json.len()), "{}", json.len());
    layer_replays_byte_for_byte(json, &[("content-type", b"application/json")]).await;
}

/// 40 KB of binary, over the store's 64 KiB cap in hex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_replays_a_40_kb_binary_response_byte_for_byte() {
    let binary: Vec<u8> = (0..40_000u32).map(|i| (i * 31 % 251) as u8).collect();
    assert!(std::str::from_utf8(&binary).is_err());
    layer_replays_byte_for_byte(binary, &[("content-type", b"application/octet-stream")]).await;
}

/// Recorded header values that are not ASCII, in UTF-8 and in Latin-1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_replays_non_ascii_header_values_byte_for_byte() {
    layer_replays_byte_for_byte(
        b"ok".to_vec(),
        &[
            ("content-language", "de-CH, Zürich".as_bytes()),
            ("x-note", b"caf\xe9 cr\xe8me"),
        ],
    )
    .await;
}

/// A key idem refuses as empty (here from a request body, not the header, which the
/// extractor already checks) is a 400 problem+json, like an empty header; the handler
/// does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_key_reaching_the_runtime_is_400() {
    use axum::extract::State;
    use idem_runtime::http::{Principal, Problem};
    use idem_runtime::{Idem, IdemError, idempotent};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Order {
        reference: String,
    }

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Placed {
        reference: String,
    }

    impl axum::response::IntoResponse for Placed {
        fn into_response(self) -> axum::response::Response {
            axum::Json(self).into_response()
        }
    }

    struct ApiError(Problem);

    impl From<IdemError> for ApiError {
        fn from(e: IdemError) -> Self {
            ApiError(e.into())
        }
    }

    impl axum::response::IntoResponse for ApiError {
        fn into_response(self) -> axum::response::Response {
            self.0.into_response()
        }
    }

    static RUNS: AtomicUsize = AtomicUsize::new(0);

    #[idempotent(store = idem, key = order.reference, scope = principal, retain = "1h")]
    async fn place(
        #[idem(skip)] State(idem): State<Idem>,
        #[idem(skip)] principal: Principal,
        axum::Json(order): axum::Json<Order>,
    ) -> Result<Placed, ApiError> {
        RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(Placed {
            reference: order.reference,
        })
    }

    let router = axum::Router::new()
        .route("/orders", axum::routing::post(place))
        .with_state(Idem::memory());
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |reference: &str| {
        client
            .post(format!("{base}/orders"))
            .json(&json!({ "reference": reference }))
            .send()
    };
    let r = Reply::read(post("").await.unwrap()).await;
    r.assert_problem(StatusCode::BAD_REQUEST, types::INVALID_KEY);
    assert_eq!(r.body["rule"], KeyRejection::Empty.rule(), "{r:?}");
    assert_eq!(RUNS.load(Ordering::SeqCst), 0, "the handler ran");
    let placed = post("o-1").await.unwrap();
    assert_eq!(placed.status(), StatusCode::OK);
    assert_eq!(RUNS.load(Ordering::SeqCst), 1);
}

/// `Option<IdempotencyKey>`: no header is `None`, an invalid one is still a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_key_extractor() {
    let router = axum::Router::new().route(
        "/",
        axum::routing::post(|key: Option<IdempotencyKey>| async move {
            key.map_or("none".to_owned(), |k| k.to_string())
        }),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let none = client.post(&base).send().await.unwrap();
    assert_eq!(none.text().await.unwrap(), "none");
    let some = client
        .post(&base)
        .header("idempotency-key", "\"a b\"")
        .send()
        .await
        .unwrap();
    assert_eq!(some.text().await.unwrap(), "a b");
    let bad = Reply::read(
        client
            .post(&base)
            .header("idempotency-key", "a b")
            .send()
            .await
            .unwrap(),
    )
    .await;
    bad.assert_problem(StatusCode::BAD_REQUEST, types::INVALID_KEY);
}

/// How long a raw-TCP test waits for a reply before failing: a bound that keeps a
/// regression from hanging the suite, not a measure of speed.
const REPLY_BOUND: std::time::Duration = std::time::Duration::from_secs(60);

/// A handler that counts its runs and answers 201 with `tag`.
fn counting(
    tag: &'static str,
) -> (
    axum::routing::MethodRouter,
    Arc<std::sync::atomic::AtomicUsize>,
) {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (StatusCode::CREATED, tag)
        }
    };
    (axum::routing::post(handler), runs)
}

fn count(runs: &std::sync::atomic::AtomicUsize) -> usize {
    runs.load(std::sync::atomic::Ordering::SeqCst)
}

/// A reply read off a raw connection.
#[derive(Debug)]
struct RawReply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl RawReply {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let body: Value = serde_json::from_slice(&self.body).expect("a problem body");
        body["type"].as_str().unwrap().to_owned()
    }
}

/// Reads one HTTP/1.1 reply from `stream`: its head, then its body by `Content-Length`
/// (or to the end of the connection).
async fn read_raw_reply(stream: &mut TcpStream) -> RawReply {
    use tokio::io::AsyncReadExt;
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "connection closed before a reply: {buf:?}");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8(buf[..head_end].to_vec()).unwrap();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status in {head:?}"));
        let mut reply = RawReply {
            status,
            head,
            body: buf[head_end..].to_vec(),
        };
        let length: Option<usize> = reply.header("content-length").map(|v| v.parse().unwrap());
        while length.is_none_or(|len| reply.body.len() < len) {
            let n = stream.read(&mut chunk).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            reply.body.extend_from_slice(&chunk[..n]);
        }
        reply
    };
    tokio::time::timeout(REPLY_BOUND, read)
        .await
        .expect("no reply in time: the server is waiting for a body it should not need")
}

/// Opens a connection to `base` and sends a POST's head for `path` declaring
/// `content_length` bytes of body, then `body` (all, part or none of them).
async fn raw_post(
    base: &str,
    path: &str,
    key: &str,
    content_length: usize,
    body: &[u8],
) -> TcpStream {
    use tokio::io::AsyncWriteExt;
    let addr = base.strip_prefix("http://").unwrap();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/octet-stream\r\nContent-Length: {content_length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    stream
}

/// Two nested routers, each with its own `IdempotencyLayer` under the default name:
/// axum strips the nest prefix, yet one key on both routes is two operations, each
/// handler runs once and each retry replays its own route's response. Under one
/// explicit name shared on purpose, the same key on the other route is a 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_routers_answer_one_key_each_with_their_own_response() {
    use axum::Router;
    use idem_runtime::http::IdempotencyLayer;
    let idem = idem_runtime::Idem::sqlite("sqlite::memory:").await.unwrap();
    let (v1, v1_runs) = counting("v1");
    let (v2, v2_runs) = counting("v2");
    let (s1, s1_runs) = counting("s1");
    let (s2, s2_runs) = counting("s2");
    let shared = IdempotencyLayer::new(idem.clone()).name("payments");
    let router = Router::new()
        .nest(
            "/v1",
            Router::new()
                .route("/payments", v1)
                .route_layer(IdempotencyLayer::new(idem.clone())),
        )
        .nest(
            "/v2",
            Router::new()
                .route("/payments", v2)
                .layer(IdempotencyLayer::new(idem.clone())),
        )
        .nest(
            "/s1",
            Router::new()
                .route("/payments", s1)
                .route_layer(shared.clone()),
        )
        .nest(
            "/s2",
            Router::new().route("/payments", s2).route_layer(shared),
        );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |path: &str| {
        client
            .post(format!("{base}{path}"))
            .header("idempotency-key", "one-key")
            .send()
    };
    for replayed in [false, true] {
        for (path, tag) in [("/v1/payments", "v1"), ("/v2/payments", "v2")] {
            let res = post(path).await.unwrap();
            assert_eq!(res.status(), StatusCode::CREATED, "{path}");
            assert_eq!(
                res.headers().get("idempotent-replayed").is_some(),
                replayed,
                "{path}"
            );
            assert_eq!(
                res.text().await.unwrap(),
                tag,
                "{path} answered another route's response"
            );
        }
    }
    assert_eq!((count(&v1_runs), count(&v2_runs)), (1, 1));

    let first = post("/s1/payments").await.unwrap();
    assert_eq!(first.text().await.unwrap(), "s1");
    let other = Reply::read(post("/s2/payments").await.unwrap()).await;
    other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    assert_eq!((count(&s1_runs), count(&s2_runs)), (1, 0));
}

/// A framework's refusal (415 from axum's `Json`, 405 for a method the route lacks) is
/// passed on unrecorded, so the corrected retry with the same key runs; and the
/// `Content-Type` is part of the request, so the same key with another media type is a
/// 422, not a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_not_recorded_and_the_media_type_is_fingerprinted() {
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let create = {
        let runs = runs.clone();
        move |axum::Json(item): axum::Json<Value>| async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (StatusCode::CREATED, axum::Json(item))
        }
    };
    let router = axum::Router::new()
        .route("/items", axum::routing::post(create))
        .route_layer(
            idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory())
                .methods([reqwest::Method::POST, reqwest::Method::PATCH]),
        );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let send = |method: reqwest::Method, key: &str, content_type: &str| {
        client
            .request(method, format!("{base}/items"))
            .header("idempotency-key", key)
            .header("content-type", content_type)
            .body(r#"{"name": "lamp"}"#)
            .send()
    };
    let post = |key, content_type| send(reqwest::Method::POST, key, content_type);

    let refused = post("k", "text/plain").await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(count(&runs), 0);
    let corrected = post("k", "application/json").await.unwrap();
    assert_eq!(
        corrected.status(),
        StatusCode::CREATED,
        "the corrected retry got the recorded refusal"
    );
    assert!(corrected.headers().get("idempotent-replayed").is_none());
    assert_eq!(count(&runs), 1);
    let replay = post("k", "application/json").await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    // The same key and bytes under another media type: another request.
    let other = Reply::read(post("k", "application/vnd.api+json").await.unwrap()).await;
    other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    // A method the route lacks is a 405 the client corrects; the key stays free.
    let wrong = send(reqwest::Method::PATCH, "k2", "application/json")
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
    let right = post("k2", "application/json").await.unwrap();
    assert_eq!(
        right.status(),
        StatusCode::CREATED,
        "the key was held by the recorded 405"
    );
    assert_eq!(count(&runs), 2);
}

/// A query in another order or spelling, and a JSON body with its keys reordered and
/// other whitespace, are the same request: the retry replays. Another value is a 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equivalent_queries_and_json_bodies_replay() {
    let (route, runs) = counting("ok");
    let router = axum::Router::new().route("/q", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory()),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |query: &str, body: &str| {
        client
            .post(format!("{base}/q?{query}"))
            .header("idempotency-key", "k")
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
    };
    let first = post("b=2&a=1", r#"{"x":1,"y":[1,2],"z":{"b":true,"a":null}}"#)
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let same = post(
        "a=1&b=%32",
        "{ \"z\" : { \"a\": null, \"b\": true },\n  \"y\": [1, 2],\t\"x\": 1 }\n",
    )
    .await
    .unwrap();
    assert_eq!(same.status(), StatusCode::CREATED);
    assert_eq!(
        same.headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "an equivalent request was not replayed"
    );
    let other_query = Reply::read(
        post("a=1&b=3", r#"{"x":1,"y":[1,2],"z":{"a":null,"b":true}}"#)
            .await
            .unwrap(),
    )
    .await;
    other_query.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    let other_body = Reply::read(
        post("a=1&b=2", r#"{"x":1,"y":[2,1],"z":{"a":null,"b":true}}"#)
            .await
            .unwrap(),
    )
    .await;
    other_body.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    assert_eq!(count(&runs), 1);
}

/// A declared `Content-Length` over the cap is refused with a 413 problem at once: the
/// client sends only the head, and the reply comes without the body being read; the
/// handler does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_oversize_body_is_413_before_it_is_sent() {
    let (route, runs) = counting("ok");
    let router = axum::Router::new().route("/r", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory()),
    );
    let base = serve_as_alice(router).await;
    let mut stream = raw_post(&base, "/r", "k", (1 << 20) + 1, b"").await;
    let reply = read_raw_reply(&mut stream).await;
    assert_eq!(reply.status, 413, "{reply:?}");
    assert_eq!(
        reply.problem_type(),
        idem_runtime::http::type_uri(types::BODY_TOO_LARGE)
    );
    assert_eq!(count(&runs), 0);
}

/// A body that stops arriving is a 408 problem once the layer's body timeout passes;
/// the handler does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_body_is_408() {
    let (route, runs) = counting("ok");
    let router = axum::Router::new().route("/r", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory())
            .body_timeout(std::time::Duration::from_millis(200)),
    );
    let base = serve_as_alice(router).await;
    let mut stream = raw_post(&base, "/r", "k", 100, &[b'x'; 10]).await;
    let reply = read_raw_reply(&mut stream).await;
    assert_eq!(reply.status, 408, "{reply:?}");
    assert_eq!(
        reply.problem_type(),
        idem_runtime::http::type_uri(types::BODY_TIMEOUT)
    );
    assert_eq!(count(&runs), 0);
}

/// With a buffer budget of 1000 bytes, a client holding 800 of them (it declared 800
/// and sent half) leaves no room for another 800-byte body: that one is a 503 with
/// `Retry-After`. The first then completes, and the budget is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_buffer_budget_are_503_with_retry_after() {
    use tokio::io::AsyncWriteExt;
    let (route, runs) = counting("ok");
    let router = axum::Router::new().route("/r", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory()).buffer_budget(1000),
    );
    let base = serve_as_alice(router).await;
    let mut held = raw_post(&base, "/r", "held", 800, &[b'x'; 400]).await;
    let client = reqwest::Client::new();
    let post = |key: String| {
        client
            .post(format!("{base}/r"))
            .header("idempotency-key", key)
            .body(vec![b'y'; 800])
            .send()
    };
    // Until the server has read the held request's head, other bodies still fit. A head
    // read while one of them holds its 800 bytes is refused at once, and answered on
    // the held stream: then another request is held in its place.
    let refused = tokio::time::timeout(REPLY_BOUND, async {
        for i in 0.. {
            let r = Reply::read(post(format!("other-{i}")).await.unwrap()).await;
            if r.status != StatusCode::CREATED {
                return r;
            }
            let mut byte = [0u8; 1];
            let unanswered = matches!(
                held.try_read(&mut byte),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
            );
            if !unanswered {
                held = raw_post(&base, "/r", &format!("held-{i}"), 800, &[b'x'; 400]).await;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        unreachable!()
    })
    .await
    .expect("no body was refused while the budget was held");
    refused.assert_problem(StatusCode::SERVICE_UNAVAILABLE, types::BUSY);
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    let before = count(&runs);
    held.write_all(&[b'x'; 400]).await.unwrap();
    let reply = read_raw_reply(&mut held).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(count(&runs), before + 1);
    let after = post("after".into()).await.unwrap();
    assert_eq!(after.status(), StatusCode::CREATED);
}

/// The claim limiter: with a burst of 2, a caller's third new key is a 429 with
/// `Retry-After` and does not run; a replay of a recorded key and another caller's new
/// key pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_keys_past_the_claim_limit_are_429() {
    let (route, runs) = counting("ok");
    let router = axum::Router::new().route("/r", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory())
            .limit_claims(2, std::time::Duration::from_secs(3600)),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |user: &str, key: &str| {
        let req = client
            .post(format!("{base}/r"))
            .header("x-user", user)
            .header("idempotency-key", key);
        async move { Reply::read(req.send().await.unwrap()).await }
    };
    assert_eq!(post("alice", "k1").await.status, StatusCode::CREATED);
    assert_eq!(post("alice", "k2").await.status, StatusCode::CREATED);
    let limited = post("alice", "k3").await;
    limited.assert_problem(StatusCode::TOO_MANY_REQUESTS, types::TOO_MANY_CLAIMS);
    let wait: u64 = limited.header("retry-after").unwrap().parse().unwrap();
    assert!((3500..=3600).contains(&wait), "{limited:?}");
    assert_eq!(count(&runs), 2);
    let replay = post("alice", "k1").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed(), "{replay:?}");
    let bob = post("bob", "k3").await;
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed(), "{bob:?}");
    // Still limited, and nothing was recorded under the refused key.
    let again = post("alice", "k3").await;
    again.assert_problem(StatusCode::TOO_MANY_REQUESTS, types::TOO_MANY_CLAIMS);
    assert_eq!(count(&runs), 3);
}

/// What the routes of `retry_after_follows_the_routes_durations` do: key `slow` takes
/// 1.5 s; key `held` waits until released.
#[derive(Default)]
struct Gate(Hold);

impl Gate {
    async fn act(&self, key: &str) -> u32 {
        if key == "held" {
            self.0.entered.add_permits(1);
            self.0.release.acquire().await.unwrap().forget();
        } else {
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        }
        7
    }
}

#[idem_runtime::idempotent(store = idem, key = key, scope = principal, retain = "1h",
                           in_flight = reject, name = "gated")]
async fn gated(
    #[idem(skip)] idem: &idem_runtime::Idem,
    #[idem(skip)] gate: &Gate,
    #[idem(skip)] principal: &idem_runtime::http::Principal,
    #[idem(skip)] key: &IdempotencyKey,
) -> Result<u32, idem_runtime::IdemError> {
    Ok(gate.act(key.as_str()).await)
}

/// A 409's `Retry-After` is about how long the route's requests take, not the whole
/// lease, in both styles: after a request of 1.5 s, a retry colliding with a running
/// request is told 2 s (rounded up), far under the 60 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_follows_the_routes_durations() {
    use axum::extract::{Extension, State};
    use idem_runtime::http::{IdempotencyLayer, IdempotentHandlerLayer, Principal};
    type Shared = (idem_runtime::Idem, Arc<Gate>);
    let idem = idem_runtime::Idem::memory();
    let gate = Arc::new(Gate::default());
    let by_attribute = axum::routing::post(
        |State((idem, gate)): State<Shared>,
         Extension(principal): Extension<Principal>,
         key: IdempotencyKey| async move {
            gated(&idem, &gate, &principal, &key).await.map(axum::Json)
        },
    );
    let by_layer = axum::routing::post(
        |State((_, gate)): State<Shared>, key: IdempotencyKey| async move {
            axum::Json(gate.act(key.as_str()).await)
        },
    );
    let router = axum::Router::new()
        .route("/attribute", by_attribute)
        .layer(IdempotentHandlerLayer::new())
        .merge(
            axum::Router::new()
                .route("/layer", by_layer)
                .route_layer(IdempotencyLayer::new(idem.clone())),
        )
        .with_state((idem, gate.clone()));
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    for path in ["/attribute", "/layer"] {
        let post = |key: &'static str| {
            client
                .post(format!("{base}{path}"))
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body("{}")
                .send()
        };
        let held = tokio::spawn(post("held"));
        gate.0.entered.acquire().await.unwrap().forget();
        let early = Reply::read(post("held").await.unwrap()).await;
        early.assert_problem(StatusCode::CONFLICT, types::IN_FLIGHT);
        assert_eq!(
            early.retry_after(),
            1,
            "{path}: nothing has finished yet: {early:?}"
        );
        assert_eq!(early.body["retry_after"], 1, "{path}: {early:?}");

        assert_eq!(post("slow").await.unwrap().status(), StatusCode::OK);
        let late = Reply::read(post("held").await.unwrap()).await;
        late.assert_problem(StatusCode::CONFLICT, types::IN_FLIGHT);
        let secs = late.retry_after();
        assert!((2..=30).contains(&secs), "{path}: {late:?}");
        assert_eq!(late.body["retry_after"], secs, "{path}: {late:?}");
        gate.0.release.add_permits(1);
        assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
    }
}

/// The first answer is the route's response as it made it, every header included;
/// the record, and so every replay, keeps the recorded headers only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_response_passes_through_and_replays_keep_the_recorded_headers() {
    let (runs, route) = {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let route = axum::routing::post(move || async move {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            (
                StatusCode::CREATED,
                [
                    ("request-id", format!("req_{n}")),
                    ("stripe-should-retry", "false".to_owned()),
                    ("x-note", "kept".to_owned()),
                ],
                axum::Json(json!({"id": "ch_1"})),
            )
        });
        (runs, route)
    };
    let router = axum::Router::new().route("/charges", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory())
            .record_header(reqwest::header::HeaderName::from_static("x-note")),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = || {
        client
            .post(format!("{base}/charges"))
            .header("idempotency-key", "k")
            .send()
    };
    let first = Reply::read(post().await.unwrap()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed(), "{first:?}");
    assert_eq!(first.header("request-id"), Some("req_0"), "{first:?}");
    assert_eq!(
        first.header("stripe-should-retry"),
        Some("false"),
        "{first:?}"
    );
    assert_eq!(first.header("x-note"), Some("kept"));
    assert_eq!(first.header("content-type"), Some("application/json"));
    let replay = Reply::read(post().await.unwrap()).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!((replay.status, &replay.body), (first.status, &first.body));
    assert_eq!(replay.header("x-note"), Some("kept"));
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(
        replay.header("request-id"),
        None,
        "an unrecorded header replayed"
    );
    assert_eq!(count(&runs), 1);
}

/// An `application/x-www-form-urlencoded` body is the request by its pairs, as a
/// query is: the same parameters in another order or spelling replay, another value is
/// a 422, and a repeated name's values keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equivalent_form_bodies_replay() {
    let (route, runs) = counting("charged");
    let router = axum::Router::new().route("/v1/charges", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory()),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |key: &str, body: &str| {
        client
            .post(format!("{base}/v1/charges"))
            .header("idempotency-key", key)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.to_owned())
            .send()
    };
    let first = post("k", "amount=2000&currency=usd&description=a+lamp")
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let same = post("k", "description=a%20lamp&currency=usd&amount=2000")
        .await
        .unwrap();
    assert_eq!(
        same.headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the same parameters in another order were not replayed"
    );
    assert_eq!(same.text().await.unwrap(), "charged");
    let other = Reply::read(
        post("k", "currency=usd&amount=2001&description=a+lamp")
            .await
            .unwrap(),
    )
    .await;
    other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);

    assert_eq!(
        post("list", "expand[]=customer&expand[]=invoice")
            .await
            .unwrap()
            .status(),
        StatusCode::CREATED
    );
    let reordered = Reply::read(
        post("list", "expand[]=invoice&expand[]=customer")
            .await
            .unwrap(),
    )
    .await;
    reordered.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::KEY_REUSED);
    assert_eq!(count(&runs), 2);
}

/// A JSON body that repeats a member within one object has no one meaning: it is
/// refused with a 422 before the route runs, whatever the members' order, and the key
/// stays free for the corrected request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_bodies_repeating_a_member_are_refused() {
    let (route, runs) = counting("charged");
    let router = axum::Router::new().route("/v1/charges", route).route_layer(
        idem_runtime::http::IdempotencyLayer::new(idem_runtime::Idem::memory()),
    );
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |body: &str| {
        client
            .post(format!("{base}/v1/charges"))
            .header("idempotency-key", "k")
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
    };
    for body in [
        r#"{"amount":1,"amount":1000}"#,
        r#"{"amount":1000,"amount":1}"#,
        r#"{"card":{"number":"4242","number":"4000"}}"#,
    ] {
        let refused = Reply::read(post(body).await.unwrap()).await;
        refused.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, types::AMBIGUOUS_BODY);
        assert!(
            refused.body["detail"]
                .as_str()
                .is_some_and(|d| d.contains("member")),
            "{refused:?}"
        );
        assert!(!refused.replayed());
    }
    assert_eq!(count(&runs), 0, "an ambiguous body ran");
    let corrected = post(r#"{"amount":1000}"#).await.unwrap();
    assert_eq!(corrected.status(), StatusCode::CREATED);
    assert!(corrected.headers().get("idempotent-replayed").is_none());
    let replay = post(r#"{ "amount": 1000 }"#).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(count(&runs), 1);
}

/// Stripe's error shape, as an application renders idem's problems.
fn stripe_error(p: &idem_runtime::http::Problem) -> axum::response::Response {
    use axum::response::IntoResponse;
    let kind = match p.kind() {
        Some(types::KEY_REUSED | types::IN_FLIGHT | types::INVALID_KEY) => "idempotency_error",
        Some(_) if p.status < 500 => "invalid_request_error",
        _ => "api_error",
    };
    let body = json!({"error": {"type": kind, "message": p.message()}});
    (p.status_code(), axum::Json(body)).into_response()
}

/// A Stripe-shaped error of the handler style, answering idem's errors in its shape.
#[derive(Debug)]
struct StripeError(idem_runtime::IdemError);

impl From<idem_runtime::IdemError> for StripeError {
    fn from(e: idem_runtime::IdemError) -> Self {
        StripeError(e)
    }
}

impl axum::response::IntoResponse for StripeError {
    fn into_response(self) -> axum::response::Response {
        idem_runtime::http::error_response(&self.0, stripe_error)
    }
}

#[idem_runtime::idempotent(store = idem, key = key, scope = principal, retain = "1h",
                           in_flight = reject, name = "stripe_charge")]
async fn stripe_charge(
    #[idem(skip)] idem: &idem_runtime::Idem,
    #[idem(skip)] principal: &idem_runtime::http::Principal,
    #[idem(skip)] key: &IdempotencyKey,
    amount: i64,
) -> Result<i64, StripeError> {
    Ok(amount)
}

/// idem's refusals reach the client in the application's own error shape, in both
/// styles: `{"error": {"type": "idempotency_error", ...}}` with the status idem chose,
/// `Retry-After` kept; the routes' own responses, first or replayed, are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_render_in_the_applications_error_shape() {
    use axum::extract::{Extension, State};
    use idem_runtime::http::{IdempotencyLayer, IdempotentHandlerLayer, Principal};
    let idem = idem_runtime::Idem::memory();
    let gate = Arc::new(Gate::default());
    let by_layer = axum::routing::post(
        |State((_, gate)): State<(idem_runtime::Idem, Arc<Gate>)>,
         key: IdempotencyKey,
         axum::Json(body): axum::Json<Value>| async move {
            gate.act(key.as_str()).await;
            (StatusCode::CREATED, axum::Json(body))
        },
    );
    let by_attribute = axum::routing::post(
        |State((idem, _)): State<(idem_runtime::Idem, Arc<Gate>)>,
         Extension(principal): Extension<Principal>,
         key: IdempotencyKey,
         axum::Json(body): axum::Json<Value>| async move {
            let amount = body["amount"].as_i64().unwrap_or(0);
            stripe_charge(&idem, &principal, &key, amount)
                .await
                .map(|amount| axum::Json(json!({"amount": amount})))
        },
    );
    let router = axum::Router::new()
        .route("/attribute", by_attribute)
        .layer(IdempotentHandlerLayer::new())
        .merge(
            axum::Router::new()
                .route("/layer", by_layer)
                .route_layer(IdempotencyLayer::new(idem.clone()).problem_response(stripe_error)),
        )
        .with_state((idem, gate.clone()));
    let base = serve_as_alice(router).await;
    let client = reqwest::Client::new();
    let post = |path: &str, key: Option<&str>, body: &str| {
        let mut req = client
            .post(format!("{base}{path}"))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.send()
    };
    let assert_stripe = |r: &Reply, status: StatusCode, kind: &str| {
        assert_eq!(r.status, status, "{r:?}");
        assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
        assert_eq!(r.body["error"]["type"], kind, "{r:?}");
        assert!(r.body["error"]["message"].is_string(), "{r:?}");
    };

    for path in ["/attribute", "/layer"] {
        let first = Reply::read(post(path, Some("k"), r#"{"amount":100}"#).await.unwrap()).await;
        assert!(first.status.is_success(), "{path}: {first:?}");
        let replay = Reply::read(post(path, Some("k"), r#"{"amount":100}"#).await.unwrap()).await;
        assert!(replay.replayed(), "{path}: {replay:?}");
        assert_eq!(replay.body, first.body, "{path}");
        let reused = Reply::read(post(path, Some("k"), r#"{"amount":999}"#).await.unwrap()).await;
        assert_stripe(
            &reused,
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_error",
        );
    }

    // The layer's refusals before anything runs, and a request in flight.
    let missing = Reply::read(post("/layer", None, "{}").await.unwrap()).await;
    assert_stripe(&missing, StatusCode::BAD_REQUEST, "idempotency_error");
    let ambiguous = Reply::read(post("/layer", Some("a"), r#"{"x":1,"x":2}"#).await.unwrap()).await;
    assert_stripe(
        &ambiguous,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request_error",
    );
    let held = tokio::spawn(post("/layer", Some("held"), "{}"));
    gate.0.entered.acquire().await.unwrap().forget();
    let in_flight = Reply::read(post("/layer", Some("held"), "{}").await.unwrap()).await;
    assert_stripe(&in_flight, StatusCode::CONFLICT, "idempotency_error");
    in_flight.retry_after();
    gate.0.release.add_permits(1);
    assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::CREATED);
}

/// A charges API behind `IdempotencyLayer`, counting its effects: each charge is one
/// row (a count here) written before the handler answers. A body with `fail=1` writes
/// the charge and then answers 500, as a handler whose later step fails does.
#[derive(Default)]
struct Charges {
    rows: std::sync::atomic::AtomicUsize,
    /// The response each key's handler made, by key, to compare with what clients got.
    answered: std::sync::Mutex<std::collections::HashMap<String, Value>>,
}

async fn charge(
    axum::extract::State(charges): axum::extract::State<Arc<Charges>>,
    headers: reqwest::header::HeaderMap,
    body: String,
) -> (StatusCode, axum::Json<Value>) {
    let row = charges
        .rows
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let text = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    let key = text("idempotency-key").unwrap();
    // Which attempt of the client's ran the handler: a replay to a later attempt shows it.
    let attempt: u32 = text("x-attempt").unwrap().parse().unwrap();
    let (status, answer) = if body.contains("fail=1") {
        let error = json!({"type": "api_error", "message": "charged, then failed", "charge": row});
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({"error": error, "attempt": attempt}),
        )
    } else {
        (
            StatusCode::OK,
            json!({"id": format!("ch_{row}"), "attempt": attempt}),
        )
    };
    charges.answered.lock().unwrap().insert(key, answer.clone());
    (status, axum::Json(answer))
}

/// How long the client waits for one attempt's reply before retrying, as Stripe's
/// clients do: the reply of a connection the proxy holds silent never comes.
const ATTEMPT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// One reply a retrying client got, with the attempt it answered.
#[derive(Debug)]
struct Attempt {
    number: u32,
    reply: Reply,
}

/// POSTs `body` as a form with one `Idempotency-Key` the way Stripe's clients do:
/// retries connection errors and timeouts, 409 and every 5xx with the same key, up to
/// `retries` times, backing off between attempts. Returns every reply it got, and how
/// many attempts got none.
async fn post_like_stripe(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &str,
    retries: u32,
) -> (Vec<Attempt>, u32) {
    let (mut replies, mut lost) = (Vec::new(), 0);
    for number in 1..=retries + 1 {
        if number > 1 {
            let backoff = std::time::Duration::from_millis(50 << (number - 2).min(4));
            tokio::time::sleep(backoff).await;
        }
        let sent = client
            .post(url)
            .header("idempotency-key", key)
            .header("x-attempt", number.to_string())
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.to_owned())
            .send()
            .await;
        let read = match sent {
            Ok(res) => {
                let (status, headers) = (res.status(), res.headers().clone());
                res.bytes().await.map(|bytes| Reply {
                    status,
                    headers,
                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                })
            }
            Err(e) => Err(e),
        };
        match read {
            Ok(reply) => {
                let again = reply.status == StatusCode::CONFLICT || reply.status.is_server_error();
                replies.push(Attempt { number, reply });
                if !again {
                    break;
                }
            }
            Err(e) => {
                assert!(
                    e.is_timeout() || e.is_connect() || e.is_request() || e.is_body(),
                    "{e:?}"
                );
                lost += 1;
            }
        }
    }
    (replies, lost)
}

/// A real client that retries every 5xx, 409 and lost reply with one key, through a
/// proxy that drops or resets replies, against the layer with its defaults: a charge
/// whose handler answered 500 after writing its row runs once, and every retry gets
/// that first response, marked as a replay; with replies lost, N charges are N rows,
/// and each call ends with the response its handler made.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_retrying_5xx_through_a_lossy_proxy_charges_once_per_key() {
    use proxy::{Mode, Proxy};
    use std::sync::atomic::Ordering;
    let charges = Arc::new(Charges::default());
    let idem = idem_runtime::Idem::sqlite("sqlite::memory:").await.unwrap();
    let router = axum::Router::new()
        .route("/v1/charges", axum::routing::post(charge))
        .route_layer(idem_runtime::http::IdempotencyLayer::new(idem))
        .with_state(charges.clone());
    let base = serve_as_alice(router).await;
    let proxy = Proxy::start(base.strip_prefix("http://").unwrap()).await;
    let url = format!("http://127.0.0.1:{}/v1/charges", proxy.port);
    let client = reqwest::Client::builder()
        .timeout(ATTEMPT_TIMEOUT)
        .build()
        .unwrap();
    // Every reply is the response the key's handler made: a replay to any attempt but
    // the one that ran the handler, marked so, and the handler's own to that one.
    let check = |key: &str, attempts: &[Attempt]| {
        let made = charges.answered.lock().unwrap()[key].clone();
        for Attempt { number, reply } in attempts {
            assert_eq!(
                reply.body, made,
                "{key}: attempt {number} got another response"
            );
            let ran = made["attempt"] == *number;
            assert_eq!(reply.replayed(), !ran, "{key}: attempt {number}: {reply:?}");
        }
    };

    // 500 after the charge: three retries, the first reply dropped or not.
    for (key, mode) in [("fail-dropped", Mode::DropNextReply), ("fail", Mode::Pass)] {
        let before = charges.rows.load(Ordering::SeqCst);
        proxy.set(mode);
        let (replies, lost) = post_like_stripe(&client, &url, key, "amount=100&fail=1", 3).await;
        assert_eq!(
            charges.rows.load(Ordering::SeqCst) - before,
            1,
            "{key}: charged twice"
        );
        assert_eq!(
            lost + replies.len() as u32,
            4,
            "{key}: every 500 is retried"
        );
        assert!(replies.len() >= 3, "{key}: {replies:?} ({lost} lost)");
        assert!(
            replies
                .iter()
                .all(|a| a.reply.status == StatusCode::INTERNAL_SERVER_ERROR),
            "{key}: {replies:?}"
        );
        check(key, &replies);
    }

    // N charges with replies dropped (held silent) or reset: N rows, each call ending
    // with its handler's response.
    const N: usize = 8;
    let before = charges.rows.load(Ordering::SeqCst);
    let mut faults = 0;
    for i in 0..N {
        let mode = match i % 4 {
            0 => Mode::DropNextReply,
            1 => Mode::ResetNextReply,
            _ => Mode::Pass,
        };
        proxy.set(mode);
        let key = format!("charge-{i}");
        let body = format!("amount={}&currency=eur", 100 + i);
        let (replies, lost) = post_like_stripe(&client, &url, &key, &body, 3).await;
        faults += lost;
        let last = replies.last().unwrap_or_else(|| panic!("{key}: no reply"));
        assert_eq!(last.reply.status, StatusCode::OK, "{key}: {replies:?}");
        check(&key, &replies);
    }
    assert!(faults as usize >= N / 2, "the proxy lost {faults} replies");
    assert_eq!(charges.rows.load(Ordering::SeqCst) - before, N);
    let ids: std::collections::HashSet<_> = charges
        .answered
        .lock()
        .unwrap()
        .iter()
        .filter(|(key, _)| key.starts_with("charge-"))
        .map(|(_, answer)| answer["id"].clone())
        .collect();
    assert_eq!(ids.len(), N);
}

/// `IdempotencyLayer` wraps a service of requests with any body, as tower-http's layers
/// do: here `Full<Bytes>` requests sent through `oneshot`, with no axum router around.
#[tokio::test]
async fn the_layer_takes_any_request_body() {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::body::{Body, Bytes};
    use axum::http::Request;
    use http_body_util::{BodyExt, Full};
    use idem_runtime::http::{IdempotencyLayer, Principal};
    use tower::{Layer, ServiceExt};

    let runs = Arc::new(AtomicUsize::new(0));
    let inner = {
        let runs = runs.clone();
        tower::service_fn(move |req: Request<Body>| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let body = req.into_body().collect().await.unwrap().to_bytes();
                Ok::<_, Infallible>(format!("charged {}", String::from_utf8_lossy(&body)))
            }
        })
    };
    let service = IdempotencyLayer::new(idem_runtime::Idem::memory()).layer(inner);
    let request = || {
        Request::post("/charges")
            .header("idempotency-key", "k")
            .header("content-type", "text/plain")
            .extension(Principal::new("alice"))
            .body(Full::new(Bytes::from_static(b"42")))
            .unwrap()
    };
    let read = |res: axum::response::Response| async move {
        let replayed = res.headers().get("idempotent-replayed").cloned();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (replayed, body)
    };

    let (replayed, body) = read(service.clone().oneshot(request()).await.unwrap()).await;
    assert_eq!((replayed, &body[..]), (None, &b"charged 42"[..]));
    let (replayed, body) = read(service.oneshot(request()).await.unwrap()).await;
    assert_eq!(replayed.unwrap(), "true");
    assert_eq!(&body[..], b"charged 42");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Set for the process `a_key_extracted_without_the_handler_layer_warns_once` runs its
/// check in.
const MISSING_LAYER_CHILD: &str = "IDEM_TEST_MISSING_LAYER_CHILD";

/// The WARN events of idem's HTTP module, by message.
struct HttpWarnings(Arc<std::sync::Mutex<Vec<String>>>);

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, _: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{value:?} "));
    }
}

impl tracing::Subscriber for HttpWarnings {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        *meta.level() == tracing::Level::WARN && meta.target().starts_with("idem_runtime::http")
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0.lock().unwrap().push(message.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A handler-style route without `IdempotentHandlerLayer` compiles and runs but loses
/// `Idempotent-Replayed`: the first request whose key is extracted there logs one
/// warning that names the fix, and routes under either layer log none. The warning is
/// once per process and other tests here extract keys without a layer, so the check
/// runs in a process of its own (this test binary, filtered to this test).
#[test]
fn a_key_extracted_without_the_handler_layer_warns_once() {
    if std::env::var_os(MISSING_LAYER_CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                // The test's path in the suite binary.
                "http::a_key_extracted_without_the_handler_layer_warns_once",
                "--test-threads=1",
            ])
            .env(MISSING_LAYER_CHILD, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    use axum::body::Body;
    use axum::http::Request;
    use idem_runtime::http::{IdempotencyLayer, IdempotentHandlerLayer, Principal};
    use tower::ServiceExt;

    let warnings = Arc::new(std::sync::Mutex::new(Vec::new()));
    tracing::subscriber::set_global_default(HttpWarnings(warnings.clone())).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let route = || axum::routing::post(|key: IdempotencyKey| async move { key.to_string() });
        let request = || {
            Request::post("/")
                .header("idempotency-key", "k-1")
                .extension(Principal::new("alice"))
                .body(Body::empty())
                .unwrap()
        };
        let handler_style = axum::Router::new()
            .route("/", route())
            .layer(IdempotentHandlerLayer::new());
        let layer_style = axum::Router::new()
            .route("/", route())
            .layer(IdempotencyLayer::new(idem_runtime::Idem::memory()));
        for app in [handler_style, layer_style] {
            let res = app.oneshot(request()).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        }
        assert_eq!(*warnings.lock().unwrap(), Vec::<String>::new());

        let without_layer = axum::Router::new().route("/", route());
        for _ in 0..2 {
            let res = without_layer.clone().oneshot(request()).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        }
        let warnings = warnings.lock().unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains(".layer(IdempotentHandlerLayer::new())"),
            "{warnings:?}"
        );
    });
}
