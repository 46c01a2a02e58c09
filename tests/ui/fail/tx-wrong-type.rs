use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

/// Not a sqlx transaction: the claim cannot run inside it.
pub struct Connection;

#[idempotent(store = idem, key = order.id, retain = "7d", tx = tx)]
async fn place(idem: &Idem, tx: &mut Connection, order: &Order) -> Result<(), IdemError> {
    let _ = (tx, order);
    Ok(())
}

fn main() {}
