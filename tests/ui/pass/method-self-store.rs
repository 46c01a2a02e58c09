//! Methods: `&self` receivers with `store = self.idem`, and an `impl` of a trait.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
pub struct Receipt {
    pub cents: u64,
}

pub struct Payments {
    idem: Idem,
    fee: u64,
}

impl Payments {
    /// Doc comments and visibility are kept.
    #[idempotent(store = self.idem, key = order_id, retain = "7d")]
    pub async fn charge(&self, order_id: u64, cents: u64) -> Result<Receipt, IdemError> {
        Ok(Receipt {
            cents: cents + self.fee,
        })
    }

    #[idempotent(store = &self.idem, key = (self.fee, order_id), retain = "7d")]
    pub(crate) async fn refund(&mut self, order_id: u64) -> Result<Receipt, IdemError> {
        self.fee = 0;
        Ok(Receipt { cents: order_id })
    }
}

pub trait Mailer {
    fn send(&self, to: &str) -> impl std::future::Future<Output = Result<(), IdemError>> + Send;
}

pub struct Smtp {
    idem: Idem,
}

impl Mailer for Smtp {
    #[idempotent(store = self.idem, key = to, retain = "1d")]
    async fn send(&self, to: &str) -> Result<(), IdemError> {
        Ok(())
    }
}

fn assert_send<T: Send>(_: T) {}

fn futures_are_send(payments: &Payments, smtp: &Smtp) {
    assert_send(payments.charge(1, 100));
    assert_send(smtp.send("a@example.com"));
}

fn main() {}
