// A syntax error inside the body is rustc's to report, once, where it is: the macro
// keeps the body as tokens instead of parsing it.
use idem_runtime::{idempotent, Idem, IdemError};

#[idempotent(store = idem, key = id, retain = "1d")]
async fn charge(idem: &Idem, id: u64) -> Result<u64, IdemError> {
    let cents = ;
    Ok(id + cents)
}

fn main() {}
