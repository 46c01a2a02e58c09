use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

#[idempotent(store = idem, key = order.id, retain = "7d", in_flight = queue)]
async fn send_receipt(idem: &Idem, order: &Order) -> Result<(), IdemError> {
    let _ = (idem, order);
    Ok(())
}

fn main() {}
