//! Long-running requests over HTTP (`IdempotencyLayer::accept_after`), through reqwest
//! against a real server, on SQLite and PostgreSQL: a slow handler is answered 202 with
//! a status URL, a duplicate gets the same URL, another principal's GET is a 404, and the
//! status resource turns from 202 to the recorded 201 once the handler ends; a handler
//! that ends in time answers as usual.
use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::http::{IdempotencyLayer, Principal, status_routes};
use idem_runtime::{Idem, IdemBuilder};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The payouts route: counts its runs, and waits until `release` says `true`.
#[derive(Clone)]
struct Payouts {
    runs: Arc<AtomicUsize>,
    release: watch::Receiver<bool>,
}

async fn payout(State(app): State<Payouts>, Json(body): Json<Value>) -> Response {
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut release = app.release.clone();
    let _ = release.wait_for(|go| *go).await;
    let id = format!("po_{run}");
    (
        StatusCode::CREATED,
        [("location", format!("/payouts/{id}"))],
        Json(json!({"id": id, "cents": body["cents"]})),
    )
        .into_response()
}

/// The bearer token is the principal (a stand-in for real authentication).
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

struct Server {
    base: String,
    runs: Arc<AtomicUsize>,
    release: watch::Sender<bool>,
    client: reqwest::Client,
    layer: IdempotencyLayer,
}

impl Server {
    async fn start(idem: Idem, after: Duration) -> Server {
        Server::start_with(idem, after, |layer| layer).await
    }

    async fn start_with(
        idem: Idem,
        after: Duration,
        f: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Server {
        let (release, rx) = watch::channel(false);
        let runs = Arc::new(AtomicUsize::new(0));
        let layer = f(IdempotencyLayer::new(idem.clone()).accept_after(after));
        let app = Router::new()
            .route("/payouts", post(payout))
            .with_state(Payouts {
                runs: runs.clone(),
                release: rx,
            })
            .layer(layer.clone())
            .nest("/operations", status_routes(&idem))
            .layer(middleware::from_fn(auth));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Server {
            base,
            runs,
            release,
            client: reqwest::Client::new(),
            layer,
        }
    }

    async fn post(&self, who: &str, key: &str, cents: u64) -> reqwest::Response {
        self.client
            .post(format!("{}/payouts", self.base))
            .bearer_auth(who)
            .header("idempotency-key", key)
            .json(&json!({"cents": cents}))
            .send()
            .await
            .unwrap()
    }

    async fn get(&self, who: &str, location: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{location}", self.base))
            .bearer_auth(who)
            .send()
            .await
            .unwrap()
    }
}

fn location(res: &reqwest::Response) -> String {
    res.headers()
        .get("location")
        .expect("a Location")
        .to_str()
        .unwrap()
        .to_owned()
}

async fn a_slow_handler_is_accepted_and_its_status_follows_it(idem: Idem) {
    let server = Server::start(idem, Duration::from_millis(200)).await;
    let first = server.post("alice", "payout-1", 500).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    assert!(first.headers().contains_key("retry-after"));
    let status_url = location(&first);
    assert!(status_url.starts_with("/operations/"), "{status_url}");
    let body: Value = first.json().await.unwrap();
    assert_eq!(body["status"], "pending");
    // While it runs: the status says so, a duplicate is pointed at the same status,
    // and another principal cannot see it.
    let pending = server.get("alice", &status_url).await;
    assert_eq!(pending.status(), StatusCode::ACCEPTED);
    assert!(pending.headers().contains_key("retry-after"));
    let duplicate = server.post("alice", "payout-1", 500).await;
    assert_eq!(duplicate.status(), StatusCode::ACCEPTED);
    assert_eq!(location(&duplicate), status_url);
    let mismatch = server.post("alice", "payout-1", 999).await;
    assert_eq!(mismatch.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        server.get("mallory", &status_url).await.status(),
        StatusCode::NOT_FOUND
    );
    let unknown = "/operations/AAAAAAAAAAAAAAAAAAAAAA";
    assert_eq!(
        server.get("alice", unknown).await.status(),
        StatusCode::NOT_FOUND
    );
    // The handler ends: the status resource serves its recorded response.
    server.release.send(true).unwrap();
    let done = loop {
        let res = server.get("alice", &status_url).await;
        if res.status() != StatusCode::ACCEPTED {
            break res;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(done.status(), StatusCode::CREATED);
    assert_eq!(done.headers()["idempotent-replayed"], "true");
    assert_eq!(done.headers()["location"], "/payouts/po_1");
    let body: Value = done.json().await.unwrap();
    assert_eq!(body, json!({"id": "po_1", "cents": 500}));
    // The original request's retry replays it too; the handler ran once.
    let retry = server.post("alice", "payout-1", 500).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(server.runs.load(Ordering::SeqCst), 1);
    assert!(server.layer.drain(Duration::from_secs(30)).await);
}

async fn a_handler_that_ends_in_time_answers_as_usual(idem: Idem) {
    let server = Server::start(idem, Duration::from_secs(60)).await;
    server.release.send(true).unwrap();
    let res = server.post("alice", "payout-2", 700).await;
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(!res.headers().contains_key("idempotent-replayed"));
}

/// Past `max_detached`, a slow request is answered as any other: when its handler ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_detached_bound_a_request_waits_for_its_handler() {
    let (idem, _dir) = sqlite("bound").await;
    let server = Server::start_with(idem, Duration::from_millis(100), |l| l.max_detached(1)).await;
    let first = server.post("alice", "payout-a", 1).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let second = {
        let (client, base) = (server.client.clone(), server.base.clone());
        tokio::spawn(async move {
            client
                .post(format!("{base}/payouts"))
                .bearer_auth("alice")
                .header("idempotency-key", "payout-b")
                .json(&json!({"cents": 2}))
                .send()
                .await
                .unwrap()
        })
    };
    // Both handlers are running; only the first was detached.
    while server.runs.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.release.send(true).unwrap();
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(server.layer.drain(Duration::from_secs(30)).await);
}

async fn sqlite(test: &str) -> (Idem, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}",
        dir.path().join(format!("{test}.db")).display()
    );
    (builder().sqlite(&url).await.unwrap(), dir)
}

fn builder() -> IdemBuilder {
    Idem::builder().status_secret([7u8; 32])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_accepts_a_slow_handler() {
    let (idem, _dir) = sqlite("accepts").await;
    a_slow_handler_is_accepted_and_its_status_follows_it(idem).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_answers_a_quick_handler_as_usual() {
    let (idem, _dir) = sqlite("quick").await;
    a_handler_that_ends_in_time_answers_as_usual(idem).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_accepts_a_slow_handler() {
    let test = "postgres_accepts_a_slow_handler";
    if common::postgres_skip(test).is_some() {
        return;
    }
    let table = common::unique_table(test);
    let idem = builder()
        .table(table.clone())
        .postgres(&common::postgres_url())
        .await
        .unwrap();
    a_slow_handler_is_accepted_and_its_status_follows_it(idem).await;
    common::Cleanup::for_table(&table).run().await;
}

#[test]
#[should_panic(expected = "set `IdemBuilder::status_secret`")]
fn accepting_without_a_secret_is_refused() {
    let _ = IdempotencyLayer::new(Idem::memory()).accept_after(Duration::from_secs(1));
}

/// The payouts worker (`tests/bin/payouts_worker.rs`): a server in its own process, to
/// kill.
#[cfg(feature = "postgres")]
struct PayoutsWorker {
    child: tokio::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    base: String,
}

#[cfg(feature = "postgres")]
impl PayoutsWorker {
    /// `hang`: its handler never ends (and is accepted at once); else it answers in time.
    async fn start(table: &str, runs: &str, hang: bool) -> PayoutsWorker {
        use tokio::io::AsyncBufReadExt;
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem-payouts-worker"));
        cmd.args([
            "--url",
            &common::postgres_url(),
            "--table",
            table,
            "--runs",
            runs,
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
        if hang {
            cmd.args(["--hang", "--accept-ms", "100"]);
        } else {
            // However loaded the machine, its quick handler answers within this.
            cmd.args(["--accept-ms", "60000"]);
        }
        let mut child = cmd.spawn().expect("start the payouts worker");
        let stdout = child.stdout.take().unwrap();
        let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = tokio::io::BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let _ = tx.send(line);
            }
        });
        let first = lines
            .recv()
            .await
            .expect("the worker exited before serving");
        let addr = first
            .strip_prefix("listening ")
            .expect("a `listening` line");
        PayoutsWorker {
            child,
            lines,
            base: format!("http://{addr}"),
        }
    }

    async fn line(&mut self) -> String {
        self.lines.recv().await.expect("the worker exited")
    }

    async fn kill9(mut self) {
        let pid = self.child.id().expect("running").to_string();
        let killed = std::process::Command::new("kill")
            .args(["-KILL", &pid])
            .status();
        assert!(killed.unwrap().success());
        assert!(!self.child.wait().await.unwrap().success());
    }
}

/// A process killed while its accepted handler runs leaves the claim to its lease; the
/// status resource then says the operation was interrupted, the client's retry of the
/// original request after the lease runs the handler once more at a higher epoch, and
/// the status resource serves that outcome.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_while_detached_is_taken_over_by_the_retry() {
    let test = "http_accepted_kill9";
    if common::postgres_skip(test).is_some() {
        return;
    }
    let table = common::unique_table(test);
    let runs = format!("{table}_payout_runs");
    let pool = sqlx::PgPool::connect(&common::postgres_url())
        .await
        .unwrap();
    sqlx::query(&format!(
        "CREATE TABLE {runs} (key TEXT NOT NULL, epoch BIGINT NOT NULL)"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let post = |base: String| {
        client
            .post(format!("{base}/payouts"))
            .bearer_auth("alice")
            .header("idempotency-key", "payout-9")
            .json(&json!({"cents": 900}))
            .send()
    };
    let get = |base: String, location: String| {
        client
            .get(format!("{base}{location}"))
            .bearer_auth("alice")
            .send()
    };

    let mut a = PayoutsWorker::start(&table, &runs, true).await;
    let accepted = post(a.base.clone()).await.unwrap();
    assert_eq!(accepted.status(), StatusCode::ACCEPTED);
    let status_url = location(&accepted);
    let ran = a.line().await;
    assert!(ran.starts_with("ran payout-9 "), "{ran}");
    assert_eq!(
        get(a.base.clone(), status_url.clone())
            .await
            .unwrap()
            .status(),
        StatusCode::ACCEPTED
    );
    a.kill9().await;

    let b = PayoutsWorker::start(&table, &runs, false).await;
    // Until the lease lapses the operation still looks pending; then interrupted.
    let interrupted = loop {
        let res = get(b.base.clone(), status_url.clone()).await.unwrap();
        if res.status() != StatusCode::ACCEPTED {
            break res;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(interrupted.status(), StatusCode::CONFLICT);
    let problem: Value = interrupted.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("operation-interrupted"),
        "{problem}"
    );
    let retried = post(b.base.clone()).await.unwrap();
    assert_eq!(retried.status(), StatusCode::CREATED);
    let done = get(b.base.clone(), status_url).await.unwrap();
    assert_eq!(done.status(), StatusCode::CREATED);
    assert_eq!(done.headers()["idempotent-replayed"], "true");
    let body: Value = done.json().await.unwrap();
    let epochs: Vec<i64> = sqlx::query_scalar(&format!("SELECT epoch FROM {runs} ORDER BY epoch"))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        epochs.len(),
        2,
        "the handler ran once in each process: {epochs:?}"
    );
    assert!(epochs[0] < epochs[1], "{epochs:?}");
    assert_eq!(
        body["epoch"],
        json!(epochs[1]),
        "the status serves the retry's outcome"
    );
    sqlx::query(&format!("DROP TABLE {runs}"))
        .execute(&pool)
        .await
        .unwrap();
    common::Cleanup::for_table(&table).run().await;
}

/// The handler style: an `#[idempotent]` handler behind
/// `IdempotentHandlerLayer::accept_after`.
mod handler_style {
    use super::*;
    use idem_runtime::http::{IdempotencyKey, IdempotentHandlerLayer};
    use idem_runtime::{IdemError, idempotent};
    use serde::{Deserialize, Serialize};

    #[derive(Clone)]
    struct App {
        idem: Idem,
        runs: Arc<AtomicUsize>,
        release: watch::Receiver<bool>,
    }

    #[derive(Serialize, Deserialize)]
    struct Payout {
        id: String,
        cents: u64,
    }

    impl IntoResponse for Payout {
        fn into_response(self) -> Response {
            (StatusCode::CREATED, Json(self)).into_response()
        }
    }

    #[derive(Serialize, Deserialize)]
    struct PayoutRequest {
        cents: u64,
    }

    #[idempotent(store = app.idem, key = key, scope = principal, retain = "1h")]
    async fn accepted_payout(
        #[idem(skip)] State(app): State<App>,
        #[idem(skip)] principal: Principal,
        #[idem(skip)] key: IdempotencyKey,
        Json(req): Json<PayoutRequest>,
    ) -> Result<Payout, IdemError> {
        let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let mut release = app.release.clone();
        let _ = release.wait_for(|go| *go).await;
        Ok(Payout {
            id: format!("po_{run}"),
            cents: req.cents,
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idempotent_handler_is_accepted_and_its_status_follows_it() {
        let (idem, _dir) = sqlite("handler_style").await;
        let (release, rx) = watch::channel(false);
        let runs = Arc::new(AtomicUsize::new(0));
        let layer = IdempotentHandlerLayer::new().accept_after(Duration::from_millis(200));
        let app = Router::new()
            .route("/payouts", post(accepted_payout))
            .with_state(App {
                idem: idem.clone(),
                runs: runs.clone(),
                release: rx,
            })
            .layer(layer.clone())
            .nest("/operations", status_routes(&idem))
            .layer(middleware::from_fn(auth));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let client = reqwest::Client::new();
        let post = || {
            client
                .post(format!("{base}/payouts"))
                .bearer_auth("alice")
                .header("idempotency-key", "payout-h")
                .json(&json!({"cents": 300}))
                .send()
        };
        let get = |who: &'static str, location: String| {
            client
                .get(format!("{base}{location}"))
                .bearer_auth(who)
                .send()
        };
        let first = post().await.unwrap();
        assert_eq!(first.status(), StatusCode::ACCEPTED);
        let status_url = location(&first);
        let duplicate = post().await.unwrap();
        assert_eq!(duplicate.status(), StatusCode::ACCEPTED);
        assert_eq!(location(&duplicate), status_url);
        let pending = get("alice", status_url.clone()).await.unwrap();
        assert_eq!(pending.status(), StatusCode::ACCEPTED);
        let other = get("mallory", status_url.clone()).await.unwrap();
        assert_eq!(other.status(), StatusCode::NOT_FOUND);
        release.send(true).unwrap();
        let done = loop {
            let res = get("alice", status_url.clone()).await.unwrap();
            if res.status() != StatusCode::ACCEPTED {
                break res;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(done.status(), StatusCode::OK);
        assert_eq!(done.headers()["idempotent-replayed"], "true");
        let body: Value = done.json().await.unwrap();
        assert_eq!(
            body,
            json!({"status": "completed", "outcome": {"id": "po_1", "cents": 300}})
        );
        let replay = post().await.unwrap();
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(layer.drain(Duration::from_secs(30)).await);
    }
}
