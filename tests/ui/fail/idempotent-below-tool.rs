// `#[tool]` above `#[idempotent]`: rmcp's `#[tool]` expands first and hands
// `#[idempotent]` this rewritten method, a `fn` returning a pinned boxed future.
use idem_runtime::{Idem, IdemError, idempotent};

pub struct Payments {
    idem: Idem,
}

impl Payments {
    #[idempotent(store = self.idem, key = charge_id, retain = "7d")]
    pub fn refund(
        &self,
        charge_id: String,
    ) -> ::std::pin::Pin<Box<dyn ::std::future::Future<Output = Result<String, IdemError>> + Send + '_>>
    {
        Box::pin(async move { Ok(format!("refunded {charge_id}")) })
    }
}

fn main() {}
