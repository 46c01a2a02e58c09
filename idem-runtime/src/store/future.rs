//! [`StoreFuture`]: what a store's hot-path method returns, either its answer already
//! made (a store in this process) or a boxed future that makes it (a round trip).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The answer of a [`Store`](super::Store) method: ready at once, or to be awaited.
///
/// A store that answers in this process (the memory store) returns
/// [`ready`](Self::ready): the call allocates nothing, and the state machine takes the
/// answer without a timer or a box. A store that makes a round trip returns
/// [`new`](Self::new) over an `async` block; it does its work when first polled, so a
/// future dropped unpolled has done nothing.
///
/// ```
/// use idem_runtime::store::StoreFuture;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let at_once: StoreFuture<'_, u64> = StoreFuture::ready(7);
/// let later: StoreFuture<'_, u64> = StoreFuture::new(async { 7 });
/// assert_eq!(at_once.await, later.await);
/// # }
/// ```
#[must_use = "a store future does nothing unless awaited"]
pub struct StoreFuture<'a, T>(Inner<'a, T>);

enum Inner<'a, T> {
    Ready(Option<T>),
    Boxed(Pin<Box<dyn Future<Output = T> + Send + 'a>>),
}

impl<'a, T> StoreFuture<'a, T> {
    /// An answer already made.
    pub fn ready(answer: T) -> Self {
        StoreFuture(Inner::Ready(Some(answer)))
    }

    /// An answer `future` makes, boxed.
    pub fn new(future: impl Future<Output = T> + Send + 'a) -> Self {
        StoreFuture(Inner::Boxed(Box::pin(future)))
    }

    /// The answer, if this future was made [`ready`](Self::ready); itself otherwise.
    pub fn now(self) -> Result<T, Self> {
        match self.0 {
            Inner::Ready(Some(answer)) => Ok(answer),
            other => Err(StoreFuture(other)),
        }
    }
}

impl<'a, T> From<Pin<Box<dyn Future<Output = T> + Send + 'a>>> for StoreFuture<'a, T> {
    /// A future boxed already (what `async_trait` methods return), kept as it is.
    fn from(future: Pin<Box<dyn Future<Output = T> + Send + 'a>>) -> Self {
        StoreFuture(Inner::Boxed(future))
    }
}

// Never pinned through: the answer is moved out, the boxed future is pinned in its box.
impl<T> Unpin for StoreFuture<'_, T> {}

impl<T> Future for StoreFuture<'_, T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match &mut self.get_mut().0 {
            Inner::Ready(answer) => Poll::Ready(
                answer
                    .take()
                    .expect("a store future is not polled after it answered"),
            ),
            Inner::Boxed(future) => future.as_mut().poll(cx),
        }
    }
}

impl<T> std::fmt::Debug for StoreFuture<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Inner::Ready(_) => "StoreFuture::Ready",
            Inner::Boxed(_) => "StoreFuture::Boxed",
        })
    }
}
