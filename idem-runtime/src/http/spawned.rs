//! A request's work in a task of its own, so a client that goes away does not cancel it.

use std::future::Future;

/// Runs `fut` in its own task, so dropping the caller does not cancel it. A panic in
/// it resumes in the caller, as if it had not been spawned.
pub(crate) async fn run_spawned<F>(fut: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    joined(tokio::spawn(fut).await)
}

/// What a request's task returned; its panic resumed in the caller.
pub(crate) fn joined<T>(joined: Result<T, tokio::task::JoinError>) -> T {
    match joined {
        Ok(out) => out,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            // Only a runtime shutting down cancels the task; the caller is going too.
            Err(e) => panic!("idempotent request task cancelled: {e}"),
        },
    }
}
