use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

/// Stands in for `sqlx::Transaction`: these cases fail before types matter.
pub struct Transaction;

#[idempotent(store = idem, key = order.id, retain = "7d", tx = tx, on_takeover = unknown)]
async fn send_receipt(idem: &Idem, tx: &mut Transaction, order: &Order) -> Result<(), IdemError> {
    let _ = (idem, tx, order);
    Ok(())
}

fn main() {}
