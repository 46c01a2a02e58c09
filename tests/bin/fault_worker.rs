//! A process for `tests/suite/faults.rs` to kill, freeze and restart: it charges each key once
//! through the toy provider (`tests/common/provider.rs`), passing the operation's
//! downstream key, and prints one line per key.
//!
//! Usage: `idem-fault-worker --url PG --table T --provider URL --keys a,b,c
//! [--pause-at before-call|after-call|before-record] [--lease-ms N]
//! [--on-takeover rerun|unknown]`.
//!
//! At the pause point it prints `paused KEY` and waits for a line `go` on stdin. Per
//! key it ends with `done KEY epoch=E charge=ID replayed=BOOL` or `error KEY KIND: MSG`.

#[path = "worker_support.rs"]
mod worker_support;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use idem_runtime::store::{Delegate, Fence, OperationId, Store, StoreError, StoredOutcome};
use idem_runtime::{Idem, IdemError, InFlight, Takeover, current, observe};
use serde::{Deserialize, Serialize};
use worker_support::{Pause, WorkerArgs, run_keys};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    worker: WorkerArgs,
    #[arg(long, default_value = "rerun")]
    on_takeover: String,
}

/// What `charge` records, as `examples/reconcile.rs` records it.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    charge_id: u64,
    amount_cents: i64,
}

#[derive(Deserialize)]
struct Charge {
    id: u64,
    amount_cents: i64,
}

/// Pauses before every record: the body has returned, its outcome is not yet stored.
struct PauseBeforeRecord {
    inner: Arc<dyn Store>,
    pause: Pause,
}

#[async_trait::async_trait]
impl Delegate for PauseBeforeRecord {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }
    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        self.pause.at("before-record", &id.key).await;
        self.inner.record(id, epoch, outcome, retain).await
    }
}

async fn charge(
    idem: &Idem,
    http: &reqwest::Client,
    args: &Args,
    pause: &Pause,
    key: &str,
) -> Result<Receipt, IdemError> {
    let on_takeover = match args.on_takeover.as_str() {
        "unknown" => Takeover::Unknown,
        _ => Takeover::Rerun,
    };
    idem.operation("charge", key)
        .lease(Duration::from_millis(args.worker.lease_ms))
        .on_takeover(on_takeover)
        .in_flight(InFlight::Wait(Duration::from_secs(60)))
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            pause.at("before-call", key).await;
            let downstream = current().downstream_key("provider");
            let charge: Charge = http
                .post(format!("{}/charges", args.worker.provider))
                .header("Idempotency-Key", downstream)
                .json(&serde_json::json!({ "amount_cents": 1000 }))
                .send()
                .await
                .and_then(|r| r.error_for_status())
                .map_err(|e| IdemError::Config {
                    message: format!("provider: {e}"),
                })?
                .json()
                .await
                .map_err(|e| IdemError::Config {
                    message: format!("provider: {e}"),
                })?;
            pause.at("after-call", key).await;
            Ok(Receipt {
                charge_id: charge.id,
                amount_cents: charge.amount_cents,
            })
        })
        .await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Arc::new(Args::parse());
    // `paused KEY`.
    let pause = Pause::new(args.worker.pause_at.clone(), String::new);
    let layer_pause = pause.clone();
    let idem = Idem::builder()
        .table(args.worker.table.clone())
        .replay_cache_bytes(0)
        .layer(move |inner| {
            let paused: Box<dyn Delegate> = Box::new(PauseBeforeRecord {
                inner,
                pause: layer_pause.clone(),
            });
            Arc::new(paused)
        })
        .postgres(&args.worker.url)
        .await?;
    let http = reqwest::Client::new();
    run_keys(&args.worker.keys, |key| {
        let (idem, http, args, pause) = (idem.clone(), http.clone(), args.clone(), pause.clone());
        async move {
            let (result, info) = observe(charge(&idem, &http, &args, &pause, &key)).await;
            result.map(|r| {
                format!(
                    "epoch={} charge={} replayed={}",
                    info.epoch().unwrap_or(0),
                    r.charge_id,
                    info.replayed()
                )
            })
        }
    })
    .await?;
    Ok(())
}
