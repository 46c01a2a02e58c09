//! Store calls bounded by a timeout: the store's answer, or a retryable store error once
//! the time passes without one.

use std::future::Future;
use std::time::Duration;

use crate::error::StoreError;

/// `answer`, or a retryable store error once `timeout` passes without it. Dropping a
/// statement's future closes its connection (the stores never reuse one mid-protocol),
/// so a black-holed connection is not handed to the next call.
pub(crate) async fn bounded<T>(
    timeout: Duration,
    what: &'static str,
    answer: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, answer)
        .await
        .unwrap_or_else(|_| Err(no_answer(what, timeout)))
}

/// Retryable, but not "unreachable": silence cannot be told from a statement waiting on
/// a lock another call holds, so `fail_open` does not run a body on it.
pub(crate) fn no_answer(what: &str, after: Duration) -> StoreError {
    StoreError::new(
        true,
        format!(
            "the store did not answer the {what} within {after:?} (a network partition, a \
         stalled server, or more calls than its connections serve); retry later, and see \
         `IdemBuilder::store_timeout`"
        ),
    )
}
