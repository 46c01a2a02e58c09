use idem_runtime::{Idem, IdemError, idempotent};

/// Holds `IdemError`, which is not serializable, so it derives no serde traits: it
/// cannot be recorded until its `Idem` variant is `#[serde(skip)]`.
#[derive(Debug)]
pub enum PayError {
    Declined,
    Idem(IdemError),
}

impl From<IdemError> for PayError {
    fn from(e: IdemError) -> Self {
        PayError::Idem(e)
    }
}

#[idempotent(store = idem, key = order_id, retain = "7d", errors = record)]
async fn refund(idem: &Idem, order_id: u64) -> Result<u64, PayError> {
    let _ = order_id;
    Err(PayError::Declined)
}

fn main() {}
