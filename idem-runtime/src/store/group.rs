//! Group commit: concurrent writes gathered into one batch by whichever caller writes
//! next, so many callers share one statement or one transaction, and a lone caller
//! waits on nothing (a batch is whatever is waiting, never a timer).

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

/// Writes waiting for a batch, and the permits of the tasks writing batches.
#[derive(Debug)]
pub(crate) struct Gather<P> {
    waiting: Mutex<Queue<P>>,
    /// Held by each task writing a batch; FIFO, so no caller is starved.
    writers: Arc<Semaphore>,
    /// Writer's permits callers were granted.
    #[cfg(test)]
    granted: std::sync::atomic::AtomicUsize,
}

/// The writes no batch has taken yet, numbered in arrival order.
#[derive(Debug)]
struct Queue<P> {
    items: Vec<P>,
    /// Writes queued so far.
    pushed: u64,
}

impl<P> Queue<P> {
    /// Writes taken into batches so far: always the oldest, as a batch takes every
    /// write waiting.
    fn taken(&self) -> u64 {
        self.pushed - self.items.len() as u64
    }
}

impl<P: Send + 'static> Gather<P> {
    /// At most `writers` batches in flight at once.
    pub(crate) fn new(writers: usize) -> Gather<P> {
        Gather {
            waiting: Mutex::new(Queue {
                items: Vec::new(),
                pushed: 0,
            }),
            writers: Arc::new(Semaphore::new(writers.max(1))),
            #[cfg(test)]
            granted: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Queues `item` and waits for `answer`, which whoever writes its batch sends. Until
    /// a batch takes its item, a caller that gets a writer's permit takes every item
    /// waiting and hands them to `write`, which it runs itself; a caller that gives up
    /// mid-batch cancels neither the batch nor its neighbours' answers ([`Writing`]).
    /// Once its item is taken, a caller only waits for its answer: competing for
    /// permits then would pass each freed permit down a line of callers with nothing to
    /// write.
    /// `None` when the batch ended without answering (its write panicked).
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
        let mine = {
            let mut queue = lock(&self.waiting);
            queue.items.push(item);
            queue.pushed += 1;
            queue.pushed
        };
        while lock(&self.waiting).taken() < mine {
            let permit = tokio::select! {
                biased;
                done = &mut answer => return done.ok(),
                permit = self.writers.clone().acquire_owned() => permit,
            };
            // The semaphore is never closed.
            let Ok(permit) = permit else { continue };
            #[cfg(test)]
            self.granted
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let batch = {
                let mut queue = lock(&self.waiting);
                if queue.taken() >= mine {
                    // An earlier writer took ours; its answer is on the way.
                    break;
                }
                std::mem::take(&mut queue.items)
            };
            crate::metrics::batch(batch.len());
            let mut writing = Writing {
                run: Some(Box::pin(write(batch))),
                permit: Some(permit),
            };
            if let Some(run) = writing.run.as_mut() {
                run.as_mut().await;
            }
            writing.run = None;
        }
        answer.await.ok()
    }
}

/// A batch being written by the caller that took it, on the caller's own task (a hop to
/// another task costs each batch a wake-up on a machine whose cores the database
/// shares). If that caller gives up mid-batch, the rest of the batch goes on in a task
/// of its own, so neither the batch nor its neighbours' answers are cancelled.
struct Writing<F: Future<Output = ()> + Send + 'static> {
    /// The batch's write; `None` once it finished.
    run: Option<std::pin::Pin<Box<F>>>,
    /// The writer's permit, held until the write ends.
    permit: Option<OwnedSemaphorePermit>,
}

impl<F: Future<Output = ()> + Send + 'static> Drop for Writing<F> {
    fn drop(&mut self) {
        let (Some(run), permit) = (self.run.take(), self.permit.take()) else {
            return;
        };
        // A write that panicked is not resumed; outside a runtime (one shutting down)
        // there is nowhere to resume it. Either way the batch ends here, and its callers
        // are told it ended without answering.
        if std::thread::panicking() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
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
        while queued.load(Ordering::SeqCst) < 9 || lock(&gather.waiting).items.len() < 8 {
            tokio::task::yield_now().await;
        }
        release.send(true).unwrap();
        for (n, caller) in callers.into_iter().enumerate() {
            assert_eq!(caller.await.unwrap(), Some(n as u32 * 10));
        }
        assert_eq!(*lock(&batches), vec![1, 8]);
    }

    type Item = (u32, oneshot::Sender<u32>);

    /// A gather whose batches each wait at a gate of their own (the first batch to
    /// start at the first gate, and so on) and then answer every caller its number.
    struct Gated {
        gather: Arc<Gather<Item>>,
        /// Each batch's size, in the order they started.
        sizes: Arc<Mutex<Vec<usize>>>,
        gates: Vec<tokio::sync::watch::Sender<bool>>,
        holds: Arc<Vec<tokio::sync::watch::Receiver<bool>>>,
    }

    impl Gated {
        fn new(writers: usize, batches: usize) -> Gated {
            let (gates, holds) = (0..batches)
                .map(|_| tokio::sync::watch::channel(false))
                .unzip();
            Gated {
                gather: Arc::new(Gather::new(writers)),
                sizes: Arc::default(),
                gates,
                holds: Arc::new(holds),
            }
        }

        /// A caller submitting `n`, in a task of its own.
        fn submit(&self, n: u32) -> tokio::task::JoinHandle<Option<u32>> {
            let (gather, sizes, holds) =
                (self.gather.clone(), self.sizes.clone(), self.holds.clone());
            let write = move |batch: Vec<Item>| {
                let nth = {
                    let mut sizes = lock(&sizes);
                    sizes.push(batch.len());
                    sizes.len() - 1
                };
                let mut hold = holds[nth].clone();
                async move {
                    let _ = hold.wait_for(|go| *go).await;
                    for (n, reply) in batch {
                        let _ = reply.send(n);
                    }
                }
            };
            tokio::spawn(async move {
                let (tx, rx) = oneshot::channel();
                gather.submit((n, tx), rx, write).await
            })
        }

        /// Opens the gate of the `nth` batch.
        fn open(&self, nth: usize) {
            self.gates[nth].send(true).unwrap();
        }

        /// Waits until `n` batches have started.
        async fn started(&self, n: usize) {
            while lock(&self.sizes).len() < n {
                tokio::task::yield_now().await;
            }
        }

        /// Waits until `n` callers wait for a batch to take them.
        async fn queued(&self, n: usize) {
            while lock(&self.gather.waiting).items.len() < n {
                tokio::task::yield_now().await;
            }
        }
    }

    /// A caller whose write a batch has taken waits for its answer and asks for no
    /// writer's permit again: a permit freed while that batch is in flight goes to each
    /// such caller at most once, instead of round and round among them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_whose_write_was_taken_stops_asking_for_permits() {
        let g = Gated::new(2, 3);
        // Two batches of one hold both permits; eight callers queue behind them.
        let mut callers = vec![g.submit(0)];
        g.started(1).await;
        callers.push(g.submit(1));
        g.started(2).await;
        callers.extend((2..10).map(|n| g.submit(n)));
        g.queued(8).await;
        // The first permit freed goes to the first in line, which takes all eight.
        g.open(0);
        g.started(3).await;
        // The second is freed while those eight are in flight: it is passed along the
        // line of callers with nothing left to write, given every chance to go round.
        g.open(1);
        let mut callers = callers.into_iter();
        for n in 0..2 {
            assert_eq!(callers.next().unwrap().await.unwrap(), Some(n));
        }
        for _ in 0..2_000 {
            tokio::task::yield_now().await;
        }
        let granted = g.gather.granted.load(Ordering::SeqCst);
        g.open(2);
        for (n, caller) in (2..).zip(callers) {
            assert_eq!(caller.await.unwrap(), Some(n));
        }
        assert_eq!(*lock(&g.sizes), vec![1, 1, 8]);
        // The three batches' writers, and the other seven callers once each at most.
        assert!(
            granted <= 10,
            "permits granted {granted} times for three batches"
        );
    }

    /// The caller writing a batch gives up mid-batch (its task is aborted): the batch
    /// goes on without it, and its neighbours in that batch get their answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_that_gives_up_leaves_its_batch_running() {
        let g = Gated::new(1, 2);
        // A first batch holds the one permit while three callers queue behind it.
        let first = g.submit(0);
        g.started(1).await;
        let callers: Vec<_> = (1..4).map(|n| g.submit(n)).collect();
        g.queued(3).await;
        // The first in line takes all three and writes them; it gives up mid-batch.
        g.open(0);
        assert_eq!(first.await.unwrap(), Some(0));
        g.started(2).await;
        let mut callers = callers.into_iter();
        let writer = callers.next().unwrap();
        writer.abort();
        assert!(writer.await.unwrap_err().is_cancelled());
        g.open(1);
        for (n, caller) in (2..).zip(callers) {
            assert_eq!(
                caller.await.unwrap(),
                Some(n),
                "a neighbour lost its answer"
            );
        }
        assert_eq!(*lock(&g.sizes), vec![1, 3]);
    }
}
