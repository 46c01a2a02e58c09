//! A process for `tests/suite/steps_faults.rs` to kill and restart: per key it runs one
//! operation `checkout` of two steps, each a call to the toy provider
//! (`tests/common/provider.rs`) with the step's own downstream key: `charge` (1000
//! cents) and `ship` (1 cent; the provider stands in for a shipping service too).
//!
//! Usage: `idem-steps-worker --url PG --table T --provider URL --keys a,b,c
//! [--pause-at between-steps|in-second-step] [--lease-ms N]`.
//!
//! - `between-steps`: after the `charge` step returned (its value is recorded).
//! - `in-second-step`: inside the `ship` step's closure, after the provider answered
//!   (the shipment exists, the step is not recorded).
//!
//! At the pause point it prints `paused KEY epoch=E` and waits for a line `go` on stdin.
//! Each step closure that actually runs (is not replayed) prints `ran KEY LABEL` first.
//! Per key it ends with `done KEY epoch=E charge=ID ship=ID` or `error KEY KIND: MSG`.

#[path = "worker_support.rs"]
mod worker_support;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use idem_runtime::{Idem, IdemError, InFlight, current, observe, step};
use serde::Deserialize;
use worker_support::{Pause, WorkerArgs, run_keys};

#[derive(Deserialize)]
struct Charge {
    id: u64,
}

/// POSTs a charge of `amount_cents` under the downstream key of `label`; its id.
async fn post(
    http: &reqwest::Client,
    provider: &str,
    label: &str,
    amount_cents: i64,
) -> Result<u64, IdemError> {
    let provider_error = |e: reqwest::Error| IdemError::Config {
        message: format!("provider ({label}): {e}"),
    };
    let charge: Charge = http
        .post(format!("{provider}/charges"))
        .header("Idempotency-Key", current().downstream_key(label))
        .json(&serde_json::json!({ "amount_cents": amount_cents }))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(provider_error)?
        .json()
        .await
        .map_err(provider_error)?;
    Ok(charge.id)
}

async fn checkout(
    idem: &Idem,
    http: &reqwest::Client,
    args: &WorkerArgs,
    pause: &Pause,
    key: &str,
) -> Result<(u64, u64), IdemError> {
    idem.operation("checkout", key)
        .lease(Duration::from_millis(args.lease_ms))
        .in_flight(InFlight::Wait(Duration::from_secs(60)))
        .retain(Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            let charge: u64 = step("charge", || async {
                println!("ran {key} charge");
                post(http, &args.provider, "charge", 1000).await
            })
            .await?;
            pause.at("between-steps", key).await;
            let ship: u64 = step("ship", || async {
                println!("ran {key} ship");
                let id = post(http, &args.provider, "ship", 1).await?;
                pause.at("in-second-step", key).await;
                Ok::<_, IdemError>(id)
            })
            .await?;
            Ok((charge, ship))
        })
        .await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Arc::new(WorkerArgs::parse());
    // `paused KEY epoch=E`.
    let pause = Pause::new(args.pause_at.clone(), || {
        format!(" epoch={}", current().epoch())
    });
    let idem = Idem::builder()
        .table(args.table.clone())
        .replay_cache_bytes(0)
        .postgres(&args.url)
        .await?;
    let http = reqwest::Client::new();
    run_keys(&args.keys, |key| {
        let (idem, http, args, pause) = (idem.clone(), http.clone(), args.clone(), pause.clone());
        async move {
            let (result, info) = observe(checkout(&idem, &http, &args, &pause, &key)).await;
            result.map(|(charge, ship)| {
                format!(
                    "epoch={} charge={charge} ship={ship}",
                    info.epoch().unwrap_or(0),
                )
            })
        }
    })
    .await?;
    Ok(())
}
