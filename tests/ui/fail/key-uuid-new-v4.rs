use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

#[idempotent(store = idem, key = uuid::Uuid::new_v4(), retain = "7d")]
async fn send_receipt(idem: &Idem, order: &Order) -> Result<(), IdemError> {
    let _ = (idem, order);
    Ok(())
}

fn main() {}
