// An `IdempotencyKey` parameter left in the default fingerprint: it has no serde impl,
// and the key is bound to the operation already.
use idem_runtime::http::IdempotencyKey;
use idem_runtime::{Idem, IdemError, idempotent};

#[idempotent(store = idem, key = key, scope = principal, retain = "1d")]
async fn create_payment(
    idem: &Idem,
    principal: &str,
    key: IdempotencyKey,
    cents: u64,
) -> Result<u64, IdemError> {
    Ok(cents)
}

fn main() {
    let _ = create_payment;
}
