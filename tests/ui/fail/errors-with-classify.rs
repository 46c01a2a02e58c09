use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

fn classify(_: &IdemError) -> idem_runtime::Disposition {
    idem_runtime::Disposition::Release
}

#[idempotent(store = idem, key = order.id, retain = "7d", errors = record, classify = classify)]
async fn send_receipt(idem: &Idem, order: &Order) -> Result<(), IdemError> {
    let _ = (idem, order);
    Ok(())
}

fn main() {}
