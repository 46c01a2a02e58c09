// A handler's response wrapper as the outcome. Shaped like axum's and rmcp's `Json<T>`,
// which have no serde impls; the ui crate builds without axum's `json` feature.
use idem_runtime::{Idem, IdemError, idempotent};

#[derive(serde::Serialize, serde::Deserialize)]
pub struct Receipt {
    pub cents: u64,
}

pub struct Json<T>(pub T);

#[idempotent(store = idem, key = order_id, retain = "1d")]
async fn charge(idem: &Idem, order_id: u64) -> Result<Json<Receipt>, IdemError> {
    Ok(Json(Receipt { cents: order_id }))
}

fn main() {
    let _ = charge;
}
