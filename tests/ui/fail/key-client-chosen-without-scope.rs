// A key the client chooses needs the caller's principal in `scope`.
use idem_runtime::http::IdempotencyKey;
use idem_runtime::{Idem, IdemError, idempotent};

#[idempotent(store = idem, key = key, retain = "1d")]
async fn create_payment(idem: &Idem, #[idem(skip)] key: IdempotencyKey, cents: u64) -> Result<u64, IdemError> {
    Ok(cents)
}

struct Args {
    idempotency_key: IdempotencyKey,
}

#[idempotent(store = idem, key = args.idempotency_key, retain = "1d", fingerprint = none)]
async fn refund(idem: &Idem, args: &Args) -> Result<u64, IdemError> {
    Ok(1)
}

fn main() {
    let _ = (create_payment, refund);
}
