use idem_runtime::{Idem, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

#[idempotent(store = idem, key = order.id, retain = "7d")]
async fn send_receipt(idem: &Idem, order: &Order) -> Option<()> {
    let _ = (idem, order);
    Some(())
}

fn main() {}
