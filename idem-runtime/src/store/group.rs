//! Group commit: concurrent writes gathered into one batch by whichever caller writes
//! next, so many callers share one statement or one transaction, and a lone caller
//! waits on nothing (a batch is whatever is waiting, never a timer).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Semaphore, oneshot};

/// Writes waiting for a batch, and the permits of the tasks writing batches.
#[derive(Debug)]
pub(crate) struct Gather<P> {
    waiting: Mutex<Vec<P>>,
    /// Held by each task writing a batch; FIFO, so no caller is starved.
    writers: Arc<Semaphore>,
}

impl<P: Send + 'static> Gather<P> {
    /// At most `writers` batches in flight at once.
    pub(crate) fn new(writers: usize) -> Gather<P> {
        Gather {
            waiting: Mutex::new(Vec::new()),
            writers: Arc::new(Semaphore::new(writers.max(1))),
        }
    }

    /// Queues `item` and waits for `answer`, which whoever writes its batch sends. While
    /// it waits, a caller that gets a writer's permit takes every item waiting and hands
    /// them to `write`, run in a task of its own: a caller that gives up mid-batch
    /// cancels neither the batch nor its neighbours' answers. `None` when the batch
    /// ended without answering (its task panicked).
    pub(crate) async fn submit<T, W, F>(
        &self,
        item: P,
        mut answer: oneshot::Receiver<T>,
        write: W,
    ) -> Option<T>
    where
        W: Fn(Vec<P>) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        lock(&self.waiting).push(item);
        loop {
            let permit = tokio::select! {
                biased;
                done = &mut answer => return done.ok(),
                permit = self.writers.clone().acquire_owned() => permit,
            };
            // The semaphore is never closed.
            let Ok(permit) = permit else { continue };
            let batch = std::mem::take(&mut *lock(&self.waiting));
            if batch.is_empty() {
                // An earlier writer took ours; its answer is on the way.
                continue;
            }
            let run = write(batch);
            tokio::spawn(async move {
                run.await;
                drop(permit);
            });
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Callers arriving while a batch is written are answered by the next batch, all
    /// of them together, and each gets its own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiting_callers_share_a_batch_and_each_gets_its_answer() {
        let gather: Arc<Gather<(u32, oneshot::Sender<u32>)>> = Arc::new(Gather::new(1));
        let batches = Arc::new(Mutex::new(Vec::new()));
        let (release, hold) = tokio::sync::watch::channel(false);
        let write = {
            let batches = batches.clone();
            move |batch: Vec<(u32, oneshot::Sender<u32>)>| {
                let batches = batches.clone();
                let mut hold = hold.clone();
                async move {
                    lock(&batches).push(batch.len());
                    // The first batch waits until the rest are queued behind it.
                    let _ = hold.wait_for(|go| *go).await;
                    for (n, reply) in batch {
                        let _ = reply.send(n * 10);
                    }
                }
            }
        };
        let queued = Arc::new(AtomicUsize::new(0));
        let mut callers = Vec::new();
        for n in 0..9u32 {
            let (gather, write, queued) = (gather.clone(), write.clone(), queued.clone());
            callers.push(tokio::spawn(async move {
                let (tx, rx) = oneshot::channel();
                queued.fetch_add(1, Ordering::SeqCst);
                gather.submit((n, tx), rx, write).await
            }));
            if n == 0 {
                // The first caller's batch is in flight before the others arrive.
                while lock(&batches).is_empty() {
                    tokio::task::yield_now().await;
                }
            }
        }
        while queued.load(Ordering::SeqCst) < 9 || lock(&gather.waiting).len() < 8 {
            tokio::task::yield_now().await;
        }
        release.send(true).unwrap();
        for (n, caller) in callers.into_iter().enumerate() {
            assert_eq!(caller.await.unwrap(), Some(n as u32 * 10));
        }
        assert_eq!(*lock(&batches), vec![1, 8]);
    }
}
