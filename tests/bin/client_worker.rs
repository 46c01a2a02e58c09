//! Service A of `tests/suite/client.rs`, a process for the tests to kill and restart:
//! per key it runs one idempotent operation `order` (idem on PostgreSQL, in A's own
//! schema) whose body calls service B through idem's client layers, which send the
//! operation's downstream key, or publishes to JetStream with `queue::message_id`.
//!
//! Usage: `idem-client-worker --url PG --table T --provider B_URL --keys a,b
//! [--client tower|reqwest|reqwest-retry-first] [--body one-call|two-steps|publish]
//! [--nats URL --subject S] [--pause-at after-call|in-second-step] [--lease-ms N]`.
//!
//! - `--client tower`: hyper-util's client under tower's retry (3 retries of a failed
//!   request), under `PropagateKeyLayer`. `reqwest`: reqwest-middleware with
//!   `PropagateKey` then reqwest-retry's `RetryTransientMiddleware`;
//!   `reqwest-retry-first`: the same, the two middlewares the other way round.
//! - `--body one-call`: `POST B/charges` once; `after-call` pauses once B answered.
//!   `two-steps`: steps `first` and `second`, each a `POST B/charges`; `in-second-step`
//!   pauses inside `second` once B answered (the step is not recorded). `publish`: one
//!   JetStream publish with `Nats-Msg-Id`; `after-call` pauses once it is acked.
//!
//! At the pause point it prints `paused KEY` and waits for a line `go` on stdin. Per
//! key it ends with `done KEY epoch=E charges=ID,.. b_replayed=BOOL,..` (one-call,
//! two-steps), `done KEY epoch=E seq=N duplicate=BOOL` (publish) or `error KEY KIND: MSG`.

#[path = "worker_support.rs"]
mod worker_support;

use std::future::{Ready, ready};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_runtime::client::{PropagateKey, PropagateKeyLayer, PropagateKeyService};
use idem_runtime::queue::{MSG_ID_HEADER, message_id};
use idem_runtime::{Idem, IdemError, InFlight, observe, step};
use reqwest_middleware::ClientWithMiddleware;
use reqwest_retry::RetryTransientMiddleware;
use reqwest_retry::policies::ExponentialBackoff;
use serde::{Deserialize, Serialize};
use tower::retry::{Policy, Retry, RetryLayer};
use tower::{ServiceBuilder, ServiceExt};
use worker_support::{Pause, WorkerArgs, run_keys};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    worker: WorkerArgs,
    #[arg(long, default_value = "reqwest")]
    client: String,
    #[arg(long, default_value = "one-call")]
    body: String,
    #[arg(long)]
    nats: Option<String>,
    #[arg(long)]
    subject: Option<String>,
}

/// What B answers to `POST /charges`, and whether it was a replay.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Charge {
    id: i64,
    amount_cents: i64,
    #[serde(default)]
    b_replayed: bool,
}

/// Retries a request that failed (no response: a reset, a dropped connection) up to
/// three times; B's answers, whatever their status, are not retried.
#[derive(Clone)]
struct Attempts(u32);

impl<Res, E> Policy<http::Request<Full<Bytes>>, Res, E> for Attempts {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _: &mut http::Request<Full<Bytes>>,
        result: &mut Result<Res, E>,
    ) -> Option<Self::Future> {
        if result.is_ok() || self.0 == 0 {
            return None;
        }
        self.0 -= 1;
        Some(ready(()))
    }

    fn clone_request(
        &mut self,
        req: &http::Request<Full<Bytes>>,
    ) -> Option<http::Request<Full<Bytes>>> {
        let mut clone = http::Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

type Tower = PropagateKeyService<Retry<Attempts, HyperClient<HttpConnector, Full<Bytes>>>>;

/// The client A calls B with; the tower stack boxed, as it is the larger by far.
#[derive(Clone)]
enum Http {
    Tower(Box<Tower>),
    Reqwest(ClientWithMiddleware),
}

impl Http {
    fn new(kind: &str) -> Http {
        let policy = ExponentialBackoff::builder()
            .retry_bounds(Duration::from_millis(10), Duration::from_millis(50))
            .build_with_max_retries(3);
        let retry = RetryTransientMiddleware::new_with_policy(policy);
        let reqwest = reqwest_middleware::ClientBuilder::new(reqwest::Client::new());
        match kind {
            "tower" => Http::Tower(Box::new(
                ServiceBuilder::new()
                    .layer(PropagateKeyLayer::new())
                    .layer(RetryLayer::new(Attempts(3)))
                    .service(HyperClient::builder(TokioExecutor::new()).build_http()),
            )),
            "reqwest" => Http::Reqwest(reqwest.with(PropagateKey::new()).with(retry).build()),
            "reqwest-retry-first" => {
                Http::Reqwest(reqwest.with(retry).with(PropagateKey::new()).build())
            }
            other => panic!("--client {other}: tower, reqwest or reqwest-retry-first"),
        }
    }

    /// `POST {b}/charges` with `{"amount_cents": N}`: B's charge.
    async fn charge(&self, b: &str, amount_cents: i64) -> Result<Charge, IdemError> {
        let url = format!("{b}/charges");
        let body =
            serde_json::to_vec(&serde_json::json!({ "amount_cents": amount_cents })).expect("JSON");
        let (status, replayed, bytes) = match self {
            Http::Tower(client) => {
                let req = http::Request::post(&url)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .expect("a request");
                let res = (**client).clone().oneshot(req).await.map_err(b_error)?;
                let replayed = res.headers().contains_key("idempotent-replayed");
                let status = res.status();
                let bytes = res.into_body().collect().await.map_err(b_error)?;
                (status, replayed, bytes.to_bytes())
            }
            Http::Reqwest(client) => {
                let res = client
                    .post(&url)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await
                    .map_err(b_error)?;
                let replayed = res.headers().contains_key("idempotent-replayed");
                let status = res.status();
                (status, replayed, res.bytes().await.map_err(b_error)?)
            }
        };
        if !status.is_success() {
            return Err(b_error(format!(
                "{status}: {}",
                String::from_utf8_lossy(&bytes)
            )));
        }
        let mut charge: Charge = serde_json::from_slice(&bytes).map_err(b_error)?;
        charge.b_replayed = replayed;
        Ok(charge)
    }
}

fn b_error(e: impl std::fmt::Display) -> IdemError {
    IdemError::Config {
        message: format!("service B: {e}"),
    }
}

/// The outcome A records.
#[derive(Debug, Serialize, Deserialize)]
enum Outcome {
    Charges(Vec<Charge>),
    Published { seq: u64, duplicate: bool },
}

struct Worker {
    idem: Idem,
    http: Http,
    js: Option<async_nats::jetstream::Context>,
    args: Args,
    pause: Pause,
}

impl Worker {
    async fn order(&self, key: &str) -> Result<Outcome, IdemError> {
        let b = &self.args.worker.provider;
        self.idem
            .operation("order", key)
            .lease(Duration::from_millis(self.args.worker.lease_ms))
            .in_flight(InFlight::Wait(Duration::from_secs(60)))
            .retain(Duration::from_secs(86_400))
            .fingerprint_none()
            .run(|| async {
                match self.args.body.as_str() {
                    "one-call" => {
                        let charge = self.http.charge(b, 1000).await?;
                        self.pause.at("after-call", key).await;
                        Ok(Outcome::Charges(vec![charge]))
                    }
                    "two-steps" => {
                        let first: Charge = step("first", || self.http.charge(b, 100)).await?;
                        let second: Charge = step("second", || async {
                            let charge = self.http.charge(b, 200).await?;
                            self.pause.at("in-second-step", key).await;
                            Ok::<_, IdemError>(charge)
                        })
                        .await?;
                        Ok(Outcome::Charges(vec![first, second]))
                    }
                    "publish" => self.publish(key).await,
                    other => panic!("--body {other}: one-call, two-steps or publish"),
                }
            })
            .await
    }

    /// Publishes `{"order": KEY}` with the operation's message id, then pauses.
    async fn publish(&self, key: &str) -> Result<Outcome, IdemError> {
        let js = self.js.as_ref().expect("--nats");
        let subject = self.args.subject.clone().expect("--subject");
        let nats = |e: String| IdemError::Config {
            message: format!("JetStream: {e}"),
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(MSG_ID_HEADER, message_id("published")?.as_str());
        let payload = serde_json::to_vec(&serde_json::json!({ "order": key })).expect("JSON");
        let ack = js
            .publish_with_headers(subject, headers, payload.into())
            .await
            .map_err(|e| nats(e.to_string()))?
            .await
            .map_err(|e| nats(e.to_string()))?;
        self.pause.at("after-call", key).await;
        Ok(Outcome::Published {
            seq: ack.sequence,
            duplicate: ack.duplicate,
        })
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let pause = Pause::new(args.worker.pause_at.clone(), String::new);
    let idem = Idem::builder()
        .table(args.worker.table.clone())
        .replay_cache_bytes(0)
        .postgres(&args.worker.url)
        .await?;
    let js = match &args.nats {
        Some(url) => Some(async_nats::jetstream::new(async_nats::connect(url).await?)),
        None => None,
    };
    let worker = Arc::new(Worker {
        idem,
        http: Http::new(&args.client),
        js,
        pause,
        args,
    });
    run_keys(&worker.args.worker.keys.clone(), |key| {
        let worker = worker.clone();
        async move {
            let (result, info) = observe(worker.order(&key)).await;
            let epoch = info.epoch().unwrap_or(0);
            result.map(|outcome| match outcome {
                Outcome::Charges(charges) => {
                    let list = |f: fn(&Charge) -> String| {
                        charges.iter().map(f).collect::<Vec<_>>().join(",")
                    };
                    format!(
                        "epoch={epoch} replayed={} charges={} b_replayed={}",
                        info.replayed(),
                        list(|c| c.id.to_string()),
                        list(|c| c.b_replayed.to_string())
                    )
                }
                Outcome::Published { seq, duplicate } => format!(
                    "epoch={epoch} replayed={} seq={seq} duplicate={duplicate}",
                    info.replayed()
                ),
            })
        }
    })
    .await?;
    Ok(())
}
