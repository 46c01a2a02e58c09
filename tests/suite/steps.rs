//! Steps: several effects in one operation, each run once, resumed after a released
//! error, a crash or an operator's retry, on every store.
use crate::common;
use crate::suite;
use common::Ctx;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_runtime::store::Store as _;
use idem_runtime::{
    Idem, IdemError, InFlight, Resolution, State, Takeover, current, observe, step,
};
use tokio::sync::oneshot;

suite!(
    a_released_error_resumes_after_the_last_recorded_step,
    a_release_with_steps_keeps_the_request_bound,
    a_release_without_steps_frees_the_key,
    a_label_used_twice_is_refused_before_it_runs,
    a_label_no_store_can_keep_is_refused_before_it_runs,
    step_outside_a_body_is_refused,
    a_takeover_after_a_crash_resumes,
    an_attempt_that_lost_its_claim_cannot_record_a_step,
    unknown_lists_its_steps_and_a_retry_resumes,
    a_step_too_large_to_record_parks_the_operation,
    dynamic_labels_each_run_once,
);

const DAY: Duration = Duration::from_secs(86_400);

/// How many times each effect ran.
#[derive(Default)]
struct Effects {
    reserve: AtomicU32,
    charge: AtomicU32,
    receipt: AtomicU32,
}

impl Effects {
    fn counts(&self) -> [u32; 3] {
        [
            self.reserve.load(Ordering::SeqCst),
            self.charge.load(Ordering::SeqCst),
            self.receipt.load(Ordering::SeqCst),
        ]
    }
}

/// A checkout of three steps; the receipt fails while `mail_down` is set, an error
/// the default policy releases.
async fn checkout(
    idem: &Idem,
    order: &str,
    total: u64,
    effects: &Effects,
    mail_down: bool,
) -> Result<(String, u64), IdemError> {
    idem.operation("checkout", order)
        .retain(DAY)
        .fingerprint(&total)
        .run(|| async {
            let hold: String = step("reserve", || async {
                effects.reserve.fetch_add(1, Ordering::SeqCst);
                Ok::<_, IdemError>(format!("hold-{order}"))
            })
            .await?;
            let paid: u64 = step("charge", || async {
                effects.charge.fetch_add(1, Ordering::SeqCst);
                Ok::<_, IdemError>(total)
            })
            .await?;
            step("receipt", || async {
                effects.receipt.fetch_add(1, Ordering::SeqCst);
                if mail_down {
                    return Err(IdemError::Config {
                        message: "the mail server is down".into(),
                    });
                }
                Ok(())
            })
            .await?;
            Ok((hold, paid))
        })
        .await
}

async fn a_released_error_resumes_after_the_last_recorded_step(ctx: Ctx) {
    let effects = Effects::default();
    let (first, info) = observe(checkout(&ctx.idem, "o-1", 100, &effects, true)).await;
    assert!(matches!(first, Err(IdemError::Config { .. })), "{first:?}");
    assert!(!info.recorded(), "a released error is not recorded");
    assert_eq!(effects.counts(), [1, 1, 1]);
    let second = checkout(&ctx.idem, "o-1", 100, &effects, false).await;
    assert_eq!(second.unwrap(), ("hold-o-1".to_owned(), 100));
    assert_eq!(
        effects.counts(),
        [1, 1, 2],
        "the recorded steps replay; the failed one runs again"
    );
    // Completed: the final outcome replays, and no step runs.
    let (third, info) = observe(checkout(&ctx.idem, "o-1", 100, &effects, true)).await;
    assert_eq!(third.unwrap(), ("hold-o-1".to_owned(), 100));
    assert!(info.replayed());
    assert_eq!(effects.counts(), [1, 1, 2]);
}

async fn a_release_with_steps_keeps_the_request_bound(ctx: Ctx) {
    let effects = Effects::default();
    assert!(
        checkout(&ctx.idem, "o-2", 100, &effects, true)
            .await
            .is_err()
    );
    let other = checkout(&ctx.idem, "o-2", 250, &effects, false).await;
    assert!(
        matches!(other, Err(IdemError::Mismatch { .. })),
        "{other:?}"
    );
    assert_eq!(
        effects.counts(),
        [1, 1, 1],
        "nothing ran for another request"
    );
    let same = checkout(&ctx.idem, "o-2", 100, &effects, false).await;
    assert_eq!(same.unwrap().1, 100);
    assert_eq!(effects.counts(), [1, 1, 2]);
}

async fn a_release_without_steps_frees_the_key(ctx: Ctx) {
    let run = |total: u64, fail: bool| {
        ctx.idem
            .operation("plain", "k-1")
            .retain(DAY)
            .fingerprint(&total)
            .run(move || async move {
                if fail {
                    return Err(IdemError::Config {
                        message: "transient".into(),
                    });
                }
                Ok(total)
            })
    };
    assert!(run(100, true).await.is_err());
    assert_eq!(
        run(250, false).await.unwrap(),
        250,
        "another request may run"
    );
}

async fn a_label_used_twice_is_refused_before_it_runs(ctx: Ctx) {
    let ran = AtomicU32::new(0);
    let out = ctx
        .idem
        .operation("twice", "k-1")
        .retain(DAY)
        .fingerprint_none()
        .run(|| async {
            step("email", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, IdemError>(1)
            })
            .await?;
            step("email", || async {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, IdemError>(2)
            })
            .await
        })
        .await;
    match out {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("\"email\" is used twice"), "{message}")
        }
        other => panic!("a repeated label must be refused, got {other:?}"),
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "the second closure must not run"
    );
}

/// A label with a NUL (which PostgreSQL `TEXT` cannot hold) is refused on every store
/// before its closure runs, and the operation ends released, not UNKNOWN: nothing ran.
async fn a_label_no_store_can_keep_is_refused_before_it_runs(ctx: Ctx) {
    let ran = AtomicU32::new(0);
    let run = || {
        ctx.idem
            .operation("nul_label", "k-1")
            .retain(DAY)
            .fingerprint_none()
            .run(|| async {
                step("email\0to:ana", || async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, IdemError>(1)
                })
                .await
            })
    };
    let (out, info) = observe(run()).await;
    match out {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("NUL"), "{message}")
        }
        other => panic!("a label with a NUL must be refused, got {other:?}"),
    }
    assert!(!info.unknown(), "nothing ran, so nothing is in doubt");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the closure must not run");
    let id = ctx.idem.operation("nul_label", "k-1").id().clone();
    assert_eq!(
        ctx.idem.get(&id).await.unwrap(),
        None,
        "the claim was released"
    );
}

async fn step_outside_a_body_is_refused(_ctx: Ctx) {
    let ran = AtomicU32::new(0);
    let out = step("charge", || async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok::<_, IdemError>(1)
    })
    .await;
    match out {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("outside an idempotent body"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// Runs a two-step body that records its first step and then never finishes; aborts it
/// once the first step is recorded (a crash between the steps, as far as the store can
/// tell); returns the downstream key the body saw for `charge` and its epoch.
async fn crash_after_first_step(
    idem: &Idem,
    key: &str,
    lease: Duration,
    on_takeover: Takeover,
    effects: Arc<Effects>,
) -> (String, u64) {
    let (tx, rx) = oneshot::channel();
    let (idem, key) = (idem.clone(), key.to_owned());
    let task = tokio::spawn(async move {
        idem.operation("crashy", &key)
            .lease(lease)
            .on_takeover(on_takeover)
            .retain(DAY)
            .fingerprint_none()
            .run(move || async move {
                step("reserve", || async {
                    effects.reserve.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, IdemError>(7u32)
                })
                .await?;
                let _ = tx.send((current().downstream_key("charge"), current().epoch()));
                std::future::pending::<()>().await;
                Ok::<_, IdemError>(0u32)
            })
            .await
    });
    let seen = rx.await.expect("the first step was recorded");
    task.abort();
    let _ = task.await;
    seen
}

/// The taker's body: replays `reserve`, runs `charge` with the downstream key.
async fn finish_crashy(
    idem: &Idem,
    key: &str,
    effects: &Effects,
) -> Result<(u32, String), IdemError> {
    idem.operation("crashy", key)
        .lease(Duration::from_secs(30))
        .in_flight(InFlight::Wait(Duration::from_secs(30)))
        .retain(DAY)
        .fingerprint_none()
        .run(|| async {
            let held: u32 = step("reserve", || async {
                effects.reserve.fetch_add(1, Ordering::SeqCst);
                Ok::<_, IdemError>(8u32)
            })
            .await?;
            let key: String = step("charge", || async {
                effects.charge.fetch_add(1, Ordering::SeqCst);
                Ok::<_, IdemError>(current().downstream_key("charge"))
            })
            .await?;
            Ok((held, key))
        })
        .await
}

async fn a_takeover_after_a_crash_resumes(ctx: Ctx) {
    let effects = Arc::new(Effects::default());
    let lease = Duration::from_millis(300);
    let (key, epoch) =
        crash_after_first_step(&ctx.idem, "c-1", lease, Takeover::Rerun, effects.clone()).await;
    let (held, taker_key) = finish_crashy(&ctx.idem, "c-1", &effects).await.unwrap();
    assert_eq!(held, 7, "the recorded value, not a second reservation");
    assert_eq!(taker_key, key, "the same downstream key on the taker");
    assert_eq!(effects.counts(), [1, 1, 0]);
    let detail = ctx.idem.get(&crashy_id(&ctx.idem, "c-1")).await.unwrap();
    let detail = detail.expect("the record");
    assert!(detail.info.epoch > epoch, "taken over at a higher epoch");
    assert_eq!(detail.info.state, State::Completed);
    assert!(
        detail.steps.is_empty(),
        "a completed operation lists no steps"
    );
}

/// The stored identity of the `crashy` operation of `key`.
fn crashy_id(idem: &Idem, key: &str) -> idem_runtime::OperationId {
    idem.operation("crashy", key).id().clone()
}

/// Starts a call of `name`/`key` whose body reports its epoch, waits for a go, then runs
/// one step counted in `ran`: the test settles the claim's fate in between.
fn gated_step(
    idem: &Idem,
    name: &'static str,
    key: &'static str,
    lease: Duration,
    ran: Arc<AtomicU32>,
) -> (
    tokio::task::JoinHandle<Result<u32, IdemError>>,
    oneshot::Receiver<u64>,
    oneshot::Sender<()>,
) {
    let (started_tx, started_rx) = oneshot::channel::<u64>();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let idem = idem.clone();
    let task = tokio::spawn(async move {
        idem.operation(name, key)
            .lease(lease)
            .retain(DAY)
            .fingerprint_none()
            .run(move || async move {
                let _ = started_tx.send(current().epoch());
                let _ = go_rx.await;
                step("charge", || async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, IdemError>(1u32)
                })
                .await
            })
            .await
    });
    (task, started_rx, go_tx)
}

async fn an_attempt_that_lost_its_claim_cannot_record_a_step(ctx: Ctx) {
    let idem = ctx.variant(|b| b.renew_leases(false)).await;
    let lease = Duration::from_millis(200);
    let ran_late = Arc::new(AtomicU32::new(0));
    let (late, started_rx, go_tx) = gated_step(&idem, "fenced", "f-1", lease, ran_late.clone());
    let late_epoch = started_rx.await.unwrap();
    let taker = idem
        .operation("fenced", "f-1")
        .lease(Duration::from_secs(30))
        .in_flight(InFlight::Wait(Duration::from_secs(30)))
        .retain(DAY)
        .fingerprint_none()
        .run(|| async { step("charge", || async { Ok::<_, IdemError>(2u32) }).await })
        .await
        .unwrap();
    assert_eq!(taker, 2);
    go_tx.send(()).unwrap();
    let r = late.await.unwrap();
    assert!(
        matches!(r, Err(IdemError::Fenced { epoch, .. }) if epoch == late_epoch),
        "{r:?}"
    );
    assert_eq!(
        ran_late.load(Ordering::SeqCst),
        1,
        "the late step ran, unrecorded"
    );
    let again = idem
        .operation("fenced", "f-1")
        .retain(DAY)
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(0u32) })
        .await
        .unwrap();
    assert_eq!(again, 2, "the taker's outcome stands");
}

async fn unknown_lists_its_steps_and_a_retry_resumes(ctx: Ctx) {
    let effects = Arc::new(Effects::default());
    let lease = Duration::from_millis(300);
    let (_, epoch) =
        crash_after_first_step(&ctx.idem, "u-1", lease, Takeover::Unknown, effects.clone()).await;
    tokio::time::sleep(lease * 2).await;
    let call = || {
        ctx.idem
            .operation("crashy", "u-1")
            .lease(lease)
            .on_takeover(Takeover::Unknown)
            .retain(DAY)
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>((0u32, String::new())) })
    };
    match call().await {
        Err(IdemError::Unknown { epoch: e, .. }) => assert_eq!(e, epoch),
        other => panic!("a lapsed claim under on_takeover = unknown, got {other:?}"),
    }
    let id = crashy_id(&ctx.idem, "u-1");
    let detail = ctx.idem.get(&id).await.unwrap().expect("the record");
    assert_eq!(detail.info.state, State::Unknown);
    let labels: Vec<_> = detail.steps.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["reserve"], "UNKNOWN lists its completed steps");
    assert_eq!(detail.steps[0].epoch, epoch);
    assert_eq!(&detail.steps[0].outcome.body[..], b"7");
    ctx.idem
        .resolve(&id, epoch, Resolution::Retry)
        .await
        .unwrap();
    let (held, _) = finish_crashy(&ctx.idem, "u-1", &effects).await.unwrap();
    assert_eq!(held, 7, "the retry resumes: the recorded step replays");
    assert_eq!(effects.counts(), [1, 1, 0]);
}

async fn a_step_too_large_to_record_parks_the_operation(ctx: Ctx) {
    let idem = ctx.variant(|b| b.max_outcome_bytes(64)).await;
    let ran = AtomicU32::new(0);
    let call = || {
        idem.operation("big", "b-1")
            .retain(DAY)
            .fingerprint_none()
            .run(|| async {
                let doc: String = step("fetch", || async {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, IdemError>("x".repeat(1000))
                })
                .await?;
                Ok::<_, IdemError>(doc.len())
            })
    };
    match call().await {
        Err(IdemError::OutcomeTooLarge { len, max, .. }) => {
            assert_eq!((len, max), (1002, 64));
        }
        other => panic!("{other:?}"),
    }
    // The step's effect happened unrecorded: the operation is not released to run it
    // again.
    assert!(
        matches!(call().await, Err(IdemError::Unknown { .. })),
        "parked in UNKNOWN"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

async fn dynamic_labels_each_run_once(ctx: Ctx) {
    let sent = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let call = |fail_at: Option<u32>| {
        let sent = sent.clone();
        ctx.idem
            .operation("notify", "n-1")
            .retain(DAY)
            .fingerprint_none()
            .run(move || async move {
                for id in 0..5u32 {
                    let sent = sent.clone();
                    step(&format!("email:{id}"), || async move {
                        if fail_at == Some(id) {
                            return Err(IdemError::Config {
                                message: "bounce".into(),
                            });
                        }
                        sent.lock().unwrap().push(id);
                        Ok(id)
                    })
                    .await?;
                }
                Ok::<_, IdemError>(5u32)
            })
    };
    assert!(call(Some(3)).await.is_err());
    assert_eq!(call(None).await.unwrap(), 5);
    assert_eq!(*sent.lock().unwrap(), [0, 1, 2, 3, 4], "each email once");
}

/// A transactional body is one unit already: a step in it is refused before it runs.
#[tokio::test]
async fn a_step_in_a_transactional_body_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tx.db").display());
    let idem = Idem::sqlite(&url).await.unwrap();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let ran = AtomicU32::new(0);
    let op = idem.operation("tx", "t-1").retain(DAY).fingerprint_none();
    let guard = match op.begin_tx::<_, u32, IdemError>(&mut tx).await.unwrap() {
        idem_runtime::TxStep::Run(guard) => guard,
        idem_runtime::TxStep::Replay(_) => panic!("a fresh key"),
    };
    let out = guard
        .body(step("charge", || async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, IdemError>(1u32)
        }))
        .await;
    match out {
        Err(IdemError::Config { message }) => {
            assert!(message.contains("transactional body"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// The memory store, counting the reads of recorded steps and the steps recorded.
#[derive(Default)]
struct CountSteps {
    inner: idem_runtime::store::MemoryStore,
    reads: AtomicU32,
    writes: AtomicU32,
}

#[async_trait::async_trait]
impl idem_runtime::store::Delegate for CountSteps {
    fn inner(&self) -> &dyn idem_runtime::store::Store {
        &self.inner
    }

    async fn record_step(
        &self,
        id: &idem_runtime::OperationId,
        epoch: u64,
        label: &str,
        outcome: &idem_runtime::store::StoredOutcome,
    ) -> Result<idem_runtime::store::Fence, idem_runtime::store::StoreError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.record_step(id, epoch, label, outcome).await
    }

    async fn steps(
        &self,
        id: &idem_runtime::OperationId,
    ) -> Result<Vec<idem_runtime::store::StepRecord>, idem_runtime::store::StoreError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.steps(id).await
    }
}

/// What steps cost: a fresh operation reads no steps, and without steps writes none;
/// each step recorded is one write; a resumed run reads its steps once, however many
/// it replays.
#[tokio::test]
async fn steps_are_read_once_per_resumed_run_and_never_on_a_fresh_one() {
    let counted = Arc::new(CountSteps::default());
    let idem = Idem::builder().store(counted.clone() as Arc<dyn idem_runtime::store::Delegate>);
    let io = || {
        (
            counted.reads.load(Ordering::SeqCst),
            counted.writes.load(Ordering::SeqCst),
        )
    };
    let plain = idem
        .operation("plain", "p-1")
        .retain(DAY)
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(1u32) })
        .await;
    assert_eq!(plain.unwrap(), 1);
    assert_eq!(io(), (0, 0), "no steps: no step read or write");

    let run = |fail: bool| {
        idem.operation("three", "t-1")
            .retain(DAY)
            .fingerprint_none()
            .run(move || async move {
                let mut sum = 0u32;
                for n in 1..=3u32 {
                    sum += step(&format!("s{n}"), || async move { Ok::<_, IdemError>(n) }).await?;
                }
                if fail {
                    return Err(IdemError::Config {
                        message: "released".into(),
                    });
                }
                step("last", || async { Ok::<_, IdemError>(0u32) }).await?;
                Ok(sum)
            })
    };
    assert!(run(true).await.is_err());
    assert_eq!(io(), (0, 3), "a fresh run records each step, reads none");
    assert_eq!(run(false).await.unwrap(), 6);
    assert_eq!(
        io(),
        (1, 4),
        "the resumed run read its steps once, recorded one more"
    );
}

/// Once the claim's renewals have found it gone (here an operator settled the running
/// operation), a step returns `Fenced` without running its closure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_after_the_claim_was_found_gone_does_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("gone.db").display());
    let idem = Idem::sqlite(&url).await.unwrap();
    let lease = Duration::from_millis(200);
    let ran = Arc::new(AtomicU32::new(0));
    let (task, started_rx, go_tx) = gated_step(&idem, "gone", "g-1", lease, ran.clone());
    let epoch = started_rx.await.unwrap();
    let id = idem.operation("gone", "g-1").id().clone();
    idem.resolve(&id, epoch, Resolution::Retry).await.unwrap();
    // Ten leases: the claim is renewed several times a lease, so a renewal has met the
    // settled record well before the body goes on.
    tokio::time::sleep(lease * 10).await;
    go_tx.send(()).unwrap();
    let out = task.await.unwrap();
    assert!(
        matches!(out, Err(IdemError::Fenced { epoch: e, .. }) if e == epoch),
        "{out:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the closure must not run");
}
