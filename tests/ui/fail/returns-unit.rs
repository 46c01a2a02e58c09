use idem_runtime::{Idem, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

#[idempotent(store = idem, key = order.id, retain = "7d")]
async fn send_receipt(idem: &Idem, order: &Order) {
    let _ = (idem, order);
}

fn main() {}
