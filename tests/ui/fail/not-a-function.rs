use idem_runtime::idempotent;

#[idempotent(key = id, retain = "7d")]
pub struct Charge {
    pub id: u64,
}

fn main() {}
