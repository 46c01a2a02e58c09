//! Reconciling UNKNOWN operations against a provider's status lookup.
//!
//! A charge calls a payment provider with the operation's downstream key. When the
//! provider's answer is lost (a timeout after the request left), the effect may or may
//! not have happened: the call is classified UNKNOWN, and so is a lapsed claim
//! (`on_takeover = unknown`), so no retry charges blindly. A reconciler lists UNKNOWN
//! charges, asks the provider about each downstream key, and resolves: COMPLETED with
//! the provider's charge when it exists, retry when the provider proves it never
//! applied. The next call replays, or charges afresh.
//!
//! ```sh
//! cargo run -p idem-tests --example reconcile     # a demo: toy provider, SQLite file
//! cargo run -p idem-tests --example reconcile -- --url postgres://postgres@127.0.0.1:5432/test \
//!     --provider http://127.0.0.1:8080 --once   # one reconciler pass on a real store
//! ```
//!
//! The provider API it expects: `POST /charges` with `Idempotency-Key` (deduplicated
//! by that key) and `GET /charges/{key}` answering 200 with the charge or 404.

#[path = "../tests/common/provider.rs"]
mod provider;

use std::time::Duration;

use clap::Parser;
use idem_runtime::{Disposition, Idem, IdemError, ListFilter, Resolution, current};
use serde::{Deserialize, Serialize};

/// Reconcile UNKNOWN charges (with `--url`), or run the demo.
#[derive(Parser, Debug)]
struct Args {
    /// The idem store to reconcile, any URL `Idem::connect` takes (`sqlite://…`,
    /// `postgres://…`, `redis://…`, ...); none runs the demo.
    #[arg(long)]
    url: Option<String>,
    /// The idem table.
    #[arg(long, default_value = "idem_operations")]
    table: String,
    /// The provider's base URL.
    #[arg(long)]
    provider: Option<String>,
    /// One pass, then exit (otherwise a pass every `--every`).
    #[arg(long)]
    once: bool,
    /// Time between passes.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    every: Duration,
}

/// What a charge records; the reconciler records the same from the provider's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: u64,
    amount_cents: i64,
}

#[derive(Debug, Deserialize)]
struct Charge {
    id: u64,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize, thiserror::Error)]
enum ChargeError {
    #[error("the provider did not answer in time; the charge may have happened")]
    Timeout,
    #[error("{0}")]
    Idem(String),
}

impl From<IdemError> for ChargeError {
    fn from(e: IdemError) -> Self {
        ChargeError::Idem(e.to_string())
    }
}

/// The label the body and the reconciler derive the provider's key with.
const PROVIDER: &str = "provider";

/// Charges an order once. `lose_answer` simulates a timeout after the provider acted.
async fn charge(
    idem: &Idem,
    http: &reqwest::Client,
    provider: &str,
    order: &str,
    lose_answer: bool,
) -> Result<Receipt, ChargeError> {
    idem.operation("charge", order)
        .on_takeover(idem_runtime::Takeover::Unknown)
        .classify(|e: &ChargeError| match e {
            ChargeError::Timeout => Disposition::Unknown,
            ChargeError::Idem(_) => Disposition::Release,
        })
        .retain(std::time::Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async {
            let charge: Charge = http
                .post(format!("{provider}/charges"))
                .header("Idempotency-Key", current().downstream_key(PROVIDER))
                .json(&serde_json::json!({ "amount_cents": 2500 }))
                .send()
                .await
                .map_err(|_| ChargeError::Timeout)?
                .json()
                .await
                .map_err(|_| ChargeError::Timeout)?;
            if lose_answer {
                return Err(ChargeError::Timeout);
            }
            Ok(Receipt {
                charge_id: charge.id,
                amount_cents: charge.amount_cents,
            })
        })
        .await
}

/// What one pass did.
#[derive(Debug, Default)]
struct Pass {
    completed: usize,
    retried: usize,
}

/// One reconciler pass: every UNKNOWN charge, settled by what the provider knows.
async fn reconcile(
    idem: &Idem,
    http: &reqwest::Client,
    provider: &str,
) -> Result<Pass, Box<dyn std::error::Error>> {
    let filter = ListFilter::unknown().name("charge").limit(1000);
    let mut pass = Pass::default();
    for record in idem.list(&filter).await? {
        let key = record.id.downstream_key(PROVIDER);
        let answer = http.get(format!("{provider}/charges/{key}")).send().await?;
        let resolution = match answer.status() {
            reqwest::StatusCode::OK => {
                let charge: Charge = answer.json().await?;
                let receipt = Receipt {
                    charge_id: charge.id,
                    amount_cents: charge.amount_cents,
                };
                Resolution::Completed {
                    outcome: serde_json::to_value(receipt)?,
                    version: 1,
                    retain: Duration::from_secs(30 * 86_400),
                }
            }
            // The provider proves the charge never happened: running it again is safe.
            reqwest::StatusCode::NOT_FOUND => Resolution::Retry,
            status => {
                eprintln!("{}: provider answered {status}; left UNKNOWN", record.id);
                continue;
            }
        };
        let what = match resolution {
            Resolution::Retry => "retry",
            _ => "completed",
        };
        // Fenced by the epoch listed: an operation that moved meanwhile is left alone.
        match idem.resolve(&record.id, record.epoch, resolution).await {
            Ok(()) => {
                println!("resolved {} at epoch {}: {what}", record.id, record.epoch);
                if what == "retry" {
                    pass.retried += 1;
                } else {
                    pass.completed += 1;
                }
            }
            Err(IdemError::Fenced { .. }) => println!("{} moved; skipped", record.id),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(pass)
}

async fn demo(http: &reqwest::Client) -> Result<(), Box<dyn std::error::Error>> {
    let provider = provider::Provider::start().await;
    let url = provider.url();
    let path = std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "reconcile.db".into());
    let idem = Idem::sqlite(&format!("sqlite://{path}?mode=rwc")).await?;
    let order = format!("order-{}", std::process::id());

    let lost = charge(&idem, http, &url, &order, true).await;
    println!("first attempt: {lost:?} (the provider charged; the answer was lost)");
    let blocked = charge(&idem, http, &url, &order, false).await;
    println!("a retry before reconciling: {blocked:?}");
    let pass = reconcile(&idem, http, &url).await?;
    println!("reconciler: {pass:?}");
    let after = charge(&idem, http, &url, &order, false).await?;
    println!("after reconciling: {after:?} (replayed; the provider holds 1 charge)");
    assert_eq!(provider.effects(), 1);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let http = reqwest::Client::new();
    let Some(url) = &args.url else {
        return demo(&http).await;
    };
    let provider = args
        .provider
        .as_deref()
        .ok_or("--provider URL is required with --url")?;
    let idem = Idem::builder()
        .table(args.table.clone())
        .migrate(false)
        .connect(url)
        .await?;
    loop {
        let pass = reconcile(&idem, &http, provider).await?;
        println!(
            "pass: {} completed, {} retried",
            pass.completed, pass.retried
        );
        if args.once {
            return Ok(());
        }
        tokio::time::sleep(args.every).await;
    }
}
