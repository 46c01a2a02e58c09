//! An AWS Lambda function that charges a payment once per `payment_id`, however often
//! Lambda (or its caller) retries the invocation, with its records in DynamoDB.
//!
//! ```sh
//! cargo build --release --example lambda_payments   # or cargo lambda build --example …
//! # In Lambda: IDEM_TABLE names the table (created on first start if the role may);
//! # AWS_REGION and the role's credentials come from the Lambda environment.
//! ```
//!
//! Locally, against a DynamoDB-compatible server and the runtime interface emulator:
//! `AWS_ENDPOINT_URL_DYNAMODB=http://127.0.0.1:8000 AWS_ACCESS_KEY_ID=test
//! AWS_SECRET_ACCESS_KEY=test cargo run --example lambda_payments` under
//! `cargo lambda watch`.

use idem_runtime::Idem;
use idem_runtime::lambda::IdempotentLambda;
use lambda_runtime::{Error, LambdaEvent, service_fn};
use serde::{Deserialize, Serialize};

/// The event: a payment to make.
#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    payment_id: String,
    amount_cents: u64,
    currency: String,
}

/// The answer, recorded and replayed to every retry.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
    amount_cents: u64,
}

/// The side effect: in a real function, the call to the payment provider (with the
/// downstream key, see `idem_runtime::client`).
async fn charge(event: LambdaEvent<Payment>) -> Result<Receipt, Error> {
    let p = event.payload;
    Ok(Receipt {
        charge_id: format!("ch_{}", p.payment_id),
        amount_cents: p.amount_cents,
    })
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let table = std::env::var("IDEM_TABLE").unwrap_or_else(|_| "idem_operations".into());
    // The client from the environment; a function that builds its AWS clients with
    // `aws-config` passes its own to `Idem::dynamodb(client, &table)` instead.
    let idem = Idem::connect(&format!("dynamodb://{table}")).await?;
    let handler = IdempotentLambda::new(idem, "charge")
        .key_path("/payment_id")
        // The same payment id with another amount is refused, not charged.
        .fingerprint_path("/amount_cents")
        .wrap(service_fn(charge));
    lambda_runtime::run(handler).await
}
