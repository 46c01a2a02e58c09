//! `#[idem(skip)]` leaves a parameter that is not `Serialize` out of the fingerprint.
#![deny(warnings)]
#![allow(dead_code)]

use idem_runtime::{Idem, IdemError, idempotent};

pub struct Mailer;

impl Mailer {
    fn send(&self, _to: &str) {}
}

#[idempotent(store = idem, key = to, retain = "1d")]
async fn welcome(idem: &Idem, #[idem(skip)] mailer: &Mailer, to: &str) -> Result<(), IdemError> {
    mailer.send(to);
    Ok(())
}

fn main() {}
