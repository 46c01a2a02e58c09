// A builder call states its fingerprint and its retention, as the attribute does.
use idem_runtime::{Idem, IdemError};

async fn charge(idem: &Idem, order: u64, cents: u64) -> Result<u64, IdemError> {
    // No fingerprint: the same key with another amount would replay the first charge.
    let _ = idem
        .operation("charge", &order)
        .retain(std::time::Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(cents) })
        .await;
    // No retention.
    idem.operation("charge", &order)
        .fingerprint(&cents)
        .run(|| async { Ok(cents) })
        .await
}

fn main() {
    let _ = charge;
}
