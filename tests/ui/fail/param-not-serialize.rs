use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize)]
pub struct Order {
    pub id: u64,
}

pub struct Mailer;

#[idempotent(store = idem, key = order.id, retain = "7d")]
async fn send_receipt(idem: &Idem, order: &Order, mailer: &Mailer) -> Result<(), IdemError> {
    let _ = (idem, order, mailer);
    Ok(())
}

fn main() {}
