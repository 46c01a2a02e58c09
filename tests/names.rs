//! Operation names: a function is never answered with another function's outcome. A
//! defaulted name (the function's own) that two functions in the process share is
//! refused at both, whichever is called first, with a `Config` error naming both; an
//! explicit `name` may be shared on purpose.
use idem_runtime::{Idem, IdemError, idempotent, observe};
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Runs of every body in this file that must not run.
static CLASHING_RUNS: AtomicUsize = AtomicUsize::new(0);

mod stripe {
    use super::*;

    #[idempotent(store = idem, key = order_id, retain = "1d")]
    pub async fn refund(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
        CLASHING_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(format!("stripe refunded order {order_id}"))
    }
}

mod paypal {
    use super::*;

    #[idempotent(store = idem, key = order_id, retain = "1d")]
    pub async fn refund(idem: &Idem, order_id: u64) -> Result<String, IdemError> {
        CLASHING_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(format!("paypal refunded order {order_id}"))
    }
}

/// The `Config` message of `r`, which must be one.
fn config<T: std::fmt::Debug>(r: Result<T, IdemError>) -> String {
    match r {
        Err(IdemError::Config { message }) => message,
        other => panic!("expected a `Config` error, got {other:?}"),
    }
}

#[tokio::test]
async fn two_functions_defaulting_to_one_name_are_both_refused() {
    let idem = Idem::memory();
    // The first call is refused as well as the second: neither is answered with the
    // other's outcome, whichever runs first.
    let first = config(stripe::refund(&idem, 7).await);
    let second = config(paypal::refund(&idem, 7).await);
    for message in [&first, &second] {
        assert!(
            message.contains("`names::paypal::refund` (tests/names.rs:")
                && message.contains("`names::stripe::refund` (tests/names.rs:")
                && message.contains("default to the operation name `refund`"),
            "{message}"
        );
    }
    assert_eq!(first, second, "the same message from both");
    // The verdict is kept: later calls are refused too.
    let (again, info) = observe(paypal::refund(&idem, 7)).await;
    assert!(!info.replayed());
    assert_eq!(config(again), first);
    assert_eq!(CLASHING_RUNS.load(Ordering::SeqCst), 0, "no body ran");
    assert_eq!(idem.stats().await.unwrap().completed, 0, "nothing recorded");
}

pub struct Acquirer {
    idem: Idem,
}

pub struct Wallet {
    idem: Idem,
}

impl Acquirer {
    #[idempotent(store = self.idem, key = payment, retain = "1d")]
    pub async fn capture(&self, payment: u64) -> Result<u64, IdemError> {
        CLASHING_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(payment)
    }
}

impl Wallet {
    #[idempotent(store = self.idem, key = payment, retain = "1d")]
    pub async fn capture(&self, payment: u64) -> Result<u64, IdemError> {
        CLASHING_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(payment + 1)
    }
}

#[tokio::test]
async fn methods_of_one_name_in_two_impl_blocks_of_one_module_are_refused() {
    let idem = Idem::memory();
    let wallet = Wallet { idem: idem.clone() };
    let acquirer = Acquirer { idem };
    let message = config(wallet.capture(1).await);
    assert_eq!(config(acquirer.capture(1).await), message);
    // Same module and name: the places tell them apart.
    assert_eq!(
        message.matches("`names::capture` (tests/names.rs:").count(),
        2,
        "{message}"
    );
    assert_eq!(CLASHING_RUNS.load(Ordering::SeqCst), 0, "no body ran");
}

mod feed {
    use super::*;

    #[idempotent(store = idem, key = id, retain = "1d")]
    pub async fn publish<T: Serialize + Send + Sync>(
        idem: &Idem,
        id: u64,
        item: T,
    ) -> Result<u64, IdemError> {
        CLASHING_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(id)
    }
}

mod archive {
    use super::*;

    #[idempotent(store = idem, key = id, retain = "1d")]
    pub async fn publish<T: Serialize + Send + Sync>(
        idem: &Idem,
        id: u64,
        item: T,
    ) -> Result<u64, IdemError> {
        CLASHING_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(id)
    }
}

#[tokio::test]
async fn generic_functions_register_their_names_too() {
    let idem = Idem::memory();
    // Two instantiations of one generic function are one function: one site.
    let message = config(feed::publish(&idem, 1, "a").await);
    assert_eq!(config(feed::publish(&idem, 1, 5u8).await), message);
    assert_eq!(config(archive::publish(&idem, 1, "a").await), message);
    assert!(
        message.contains("`names::archive::publish`") && message.contains("`names::feed::publish`"),
        "{message}"
    );
    assert_eq!(CLASHING_RUNS.load(Ordering::SeqCst), 0, "no body ran");
}

static PAYOUT_RUNS: AtomicUsize = AtomicUsize::new(0);

mod handler {
    use super::*;

    /// The HTTP handler's entry to the payout operation.
    #[idempotent(store = idem, key = id, retain = "1d", name = "payout", fingerprint = none)]
    pub async fn payout(idem: &Idem, id: u64) -> Result<String, IdemError> {
        PAYOUT_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(format!("payout {id}"))
    }
}

mod job {
    use super::*;

    /// The retry job's entry to the same operation.
    #[idempotent(store = idem, key = id, retain = "1d", name = "payout", fingerprint = none)]
    pub async fn payout(idem: &Idem, id: u64) -> Result<String, IdemError> {
        PAYOUT_RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(format!("payout {id} from the job"))
    }
}

#[tokio::test]
async fn an_explicit_name_is_shared_on_purpose() {
    let idem = Idem::memory();
    assert_eq!(handler::payout(&idem, 3).await.unwrap(), "payout 3");
    let (retry, info) = observe(job::payout(&idem, 3)).await;
    assert!(info.replayed());
    assert_eq!(retry.unwrap(), "payout 3");
    // A builder call of the same name is the same operation too.
    let by_hand = idem
        .operation("payout", &3u64)
        .retain(Duration::from_secs(86_400))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>("by hand".to_owned()) })
        .await;
    assert_eq!(by_hand.unwrap(), "payout 3");
    assert_eq!(PAYOUT_RUNS.load(Ordering::SeqCst), 1);
}

#[idempotent(store = idem, key = id, retain = "1d")]
async fn settle(idem: &Idem, id: u64) -> Result<u64, IdemError> {
    Ok(id * 2)
}

#[tokio::test]
async fn a_defaulted_name_of_one_function_runs() {
    let idem = Idem::memory();
    assert_eq!(settle(&idem, 4).await.unwrap(), 8);
    let (again, info) = observe(settle(&idem, 4)).await;
    assert!(info.replayed());
    assert_eq!(again.unwrap(), 8);
}
