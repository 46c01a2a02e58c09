// A client-chosen key with the principal in `scope`, and a deliberately shared one.
use idem_runtime::http::IdempotencyKey;
use idem_runtime::{Idem, IdemError, idempotent};

#[idempotent(store = idem, key = key, scope = principal, retain = "1d")]
async fn create_payment(
    idem: &Idem,
    principal: &str,
    #[idem(skip)] key: IdempotencyKey,
    cents: u64,
) -> Result<u64, IdemError> {
    Ok(cents)
}

#[idempotent(store = idem, key = key, scope = "global", retain = "1d")]
async fn single_tenant(idem: &Idem, #[idem(skip)] key: &IdempotencyKey) -> Result<u64, IdemError> {
    Ok(1)
}

// A key the application derives is not checked.
#[idempotent(store = idem, key = order_id, retain = "1d")]
async fn ship(idem: &Idem, order_id: u64) -> Result<u64, IdemError> {
    Ok(order_id)
}

fn main() {
    let _ = (create_payment, single_tenant, ship);
}
