//! A "charge" service on the embedded SQLite store: a first call runs, a retry
//! replays, the same key with another amount is refused, and 50 concurrent duplicates
//! produce one charge.
//!
//! Run it with `cargo run --example quickstart`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idem_runtime::{Idem, IdemError, idempotent, observe};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize)]
struct Order {
    id: String,
    cents: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: u32,
    cents: u64,
}

#[derive(Debug, thiserror::Error)]
enum PayError {
    #[error("card declined")]
    #[allow(dead_code)]
    Declined,
    #[error(transparent)]
    Idem(#[from] IdemError),
}

/// Stands in for a payment provider; counts the charges it makes.
#[derive(Default)]
struct Provider {
    charges: AtomicU32,
}

struct Billing {
    idem: Idem,
    provider: Arc<Provider>,
}

impl Billing {
    /// Charges an order at most once per (tenant, order id) within 7 days.
    #[idempotent(store = self.idem, key = order.id, scope = tenant, retain = "7d")]
    async fn charge(&self, tenant: &str, order: &Order) -> Result<Receipt, PayError> {
        // A real provider call would pass `current().downstream_key("charge")` as its
        // own idempotency key, so even a crashed-and-retried attempt charges once.
        let charge_id = self.provider.charges.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::task::yield_now().await;
        Ok(Receipt {
            charge_id,
            cents: order.cents,
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("idem-quickstart-{}.db", std::process::id()));
    let idem = Idem::sqlite(&format!("sqlite://{}", path.display())).await?;
    let billing = Arc::new(Billing {
        idem,
        provider: Arc::default(),
    });
    let order = Order {
        id: "order-1001".into(),
        cents: 4_999,
    };

    let (first, info) = observe(billing.charge("acme", &order)).await;
    let first = first?;
    println!(
        "first call:   charged {} cents, charge #{} (replayed: {})",
        first.cents,
        first.charge_id,
        info.replayed()
    );

    let (retry, info) = observe(billing.charge("acme", &order)).await;
    let retry = retry?;
    println!(
        "retry:        got charge #{} back without charging again (replayed: {})",
        retry.charge_id,
        info.replayed()
    );

    let tampered = Order {
        cents: 99_999,
        ..order.clone()
    };
    match billing.charge("acme", &tampered).await {
        Err(PayError::Idem(e @ IdemError::Mismatch { .. })) => {
            println!("other amount: refused: {e}")
        }
        other => println!("other amount: unexpected {other:?}"),
    }

    let concurrent = Order {
        id: "order-1002".into(),
        cents: 1_250,
    };
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let (billing, order) = (billing.clone(), concurrent.clone());
            tokio::spawn(async move { billing.charge("acme", &order).await })
        })
        .collect();
    let mut ids = std::collections::BTreeSet::new();
    for call in calls {
        ids.insert(call.await??.charge_id);
    }
    println!(
        "50 concurrent duplicates of order-1002: {} distinct charge(s), #{:?}",
        ids.len(),
        ids
    );
    println!(
        "the provider made {} charges in all (one per order)",
        billing.provider.charges.load(Ordering::SeqCst)
    );
    drop(billing);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}
