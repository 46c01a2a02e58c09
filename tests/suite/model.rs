//! A seeded, model-based randomized test of the leased state machine.
//!
//! Simulated callers issue random operations on a few keys (a call with one of two
//! payloads whose body succeeds, fails, is slow, stalls past its lease or is
//! cancelled; an operator `resolve`; a purge) while the store injects faults at
//! claim, renew, record and release. A model of every body execution and every
//! answer is checked against the contract's invariants after each run.
//!
//! Each body runs two steps, one before its behaviour and one after, so crashes, stalls,
//! cancellations and released errors fall between them. A step's closure must run at
//! most once per operation, except after an attempt that ran it was cut off before the
//! step returned (a crash inside the step).
//!
//! `IDEM_MODEL_SEED=N` replays one seed; `IDEM_MODEL_RUNS=N` runs more seeds (the
//! long run); a failure prints the seed that reproduces it.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::store::{Claim, ClaimRequest, Delegate, Fence, Store, StoreError, StoredOutcome};
use idem_runtime::{
    Disposition, Idem, IdemError, InFlight, ListFilter, OperationId, Resolution, State, current,
    step,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

const KEYS: usize = 3;
const CALLERS: usize = 6;
const STEPS: usize = 10;
const LEASE: Duration = Duration::from_millis(300);
const RETAIN: Duration = Duration::from_secs(3600);

/// The body's error: a released failure, an effect in doubt, or idem's own.
#[derive(Debug, Serialize, Deserialize)]
enum ModelErr {
    Released,
    Effect,
    #[serde(skip)]
    Idem(IdemError),
}

impl From<IdemError> for ModelErr {
    fn from(e: IdemError) -> Self {
        ModelErr::Idem(e)
    }
}

fn classify(e: &ModelErr) -> Disposition {
    match e {
        ModelErr::Released => Disposition::Release,
        _ => Disposition::Unknown,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Behavior {
    Ok,
    Slow,
    Released,
    Effect,
    Stall,
    Cancel,
    /// The caller goes away within a few milliseconds: before its claim is sent, while
    /// it is on the wire, or once the body runs.
    CancelEarly,
}

#[derive(Debug)]
struct Exec {
    key: usize,
    op: OperationId,
    payload: u8,
    epoch: u64,
    stalled: bool,
    active: bool,
    /// The operator generation of its key when its call began: an operator who saw its
    /// claim (listed after the claim, so after the call began) counts a generation
    /// before resolving it, even when the body starts between the two.
    generation: u64,
    /// The body ran to its end and returned `Ok`.
    body_ok: bool,
}

type Claimed = (OperationId, u64);

/// What the faulty store saw of each claim's lease, by the test's clock: enough to tell
/// a takeover that the contract allows (the lease had lapsed) from one it forbids,
/// however slowly a loaded machine ran the statements.
#[derive(Default)]
struct Leases {
    /// Acquired claims: when the claim was sent and answered, and whether it took over.
    claims: HashMap<Claimed, (Instant, Instant)>,
    /// Successful extensions of each claim's lease (the claim itself and every renewal
    /// answered `Held`): when each was sent and answered.
    extended: HashMap<Claimed, Vec<(Instant, Instant)>>,
    /// Record attempts per claim: when sent.
    records: HashMap<Claimed, Vec<Instant>>,
    /// Claims the store made whose reply the fault injection dropped: nobody knows
    /// their epoch, so they lapse unrun.
    lost_replies: HashSet<Claimed>,
    /// Releases the fault injection failed: their claims lapse.
    failed_releases: HashSet<Claimed>,
}

impl Leases {
    /// Whether claim `epoch` of `op` surely still held its lease when the claim `taker`
    /// was decided. An extension answered before the taker was sent ran before it, and
    /// the store ran it no earlier than it was sent, so the lease then held until at
    /// least that send time plus the lease; the taker was decided before its answer.
    fn surely_live_at(&self, op: &OperationId, epoch: u64, taker: u64) -> bool {
        self.live_margin(op, epoch, taker).is_some()
    }

    /// How long before the end of claim `epoch`'s lease the claim `taker` was answered,
    /// when it surely was.
    fn live_margin(&self, op: &OperationId, epoch: u64, taker: u64) -> Option<Duration> {
        let &(taker_sent, taker_answered) = self.claims.get(&(op.clone(), taker))?;
        let last = self
            .extended
            .get(&(op.clone(), epoch))
            .into_iter()
            .flatten()
            .filter(|(_, answered)| *answered < taker_sent)
            .map(|(sent, _)| *sent)
            .max()?;
        (taker_answered < last + LEASE).then(|| last + LEASE - taker_answered)
    }

    /// The first claim of `op` after `epoch`, if any.
    fn taker(&self, op: &OperationId, epoch: u64) -> Option<u64> {
        self.claims
            .keys()
            .filter(|(o, e)| o == op && *e > epoch)
            .map(|(_, e)| *e)
            .min()
    }
}

#[derive(Default)]
struct Model {
    execs: Vec<Exec>,
    /// Bumped by every operator `resolve` on the key.
    generation: HashMap<usize, u64>,
    /// (key, payload, exec id) of every `Ok` answer.
    oks: Vec<(usize, u8, usize)>,
    /// Exec ids whose caller was told `Fenced`, and `Unrecorded`.
    fenced: Vec<usize>,
    /// (key, epoch, operator generation when the call began) of calls fenced before
    /// their body ran: their claim lapsed before they heard of it.
    fenced_unrun: Vec<(usize, u64, u64)>,
    unrecorded: Vec<(usize, String)>,
    /// Every run of a step's closure: (key, label, exec, whether its `step` returned it).
    step_runs: Vec<(usize, &'static str, usize, bool)>,
    violations: Vec<String>,
}

impl Model {
    /// A body starts; `began` is its key's operator generation when its call began,
    /// and `leases` the faulty store's view of every claim.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        key: usize,
        payload: u8,
        op: OperationId,
        epoch: u64,
        stalled: bool,
        began: u64,
        leases: &Leases,
    ) -> usize {
        let generation = *self.generation.get(&key).unwrap_or(&0);
        let id = self.execs.len();
        for (other, e) in self.execs.iter().enumerate() {
            // Two bodies of one operation at once: only after a lapsed lease or an
            // operator's resolve. A starter with the lower epoch is the stale one: its
            // claim was superseded before its body got to run.
            if e.key == key
                && e.epoch < epoch
                && e.active
                && !e.stalled
                && e.generation == generation
                && leases.surely_live_at(&op, e.epoch, epoch)
            {
                self.violations.push(format!(
                    "exec {id} (payload {payload}, epoch {epoch}) started while exec {other} \
                     (epoch {}) of key {key} was running with a live lease",
                    e.epoch
                ));
            }
        }
        self.execs.push(Exec {
            key,
            op,
            payload,
            epoch,
            stalled,
            active: true,
            generation: began,
            body_ok: false,
        });
        id
    }
}

impl Model {
    /// A step's closure starts: a violation if a run of the same step of the key by an
    /// older or the same claim was recorded (its `step` returned), since a later claim
    /// must replay it. A superseded claim's body may still run its closure (a stalled
    /// process runs on; its record is then fenced), so older claims are not checked.
    fn step_starts(&mut self, key: usize, label: &'static str, exec: usize) -> usize {
        let epoch = self.execs[exec].epoch;
        let execs = &self.execs;
        if let Some(&(_, _, first, _)) = self.step_runs.iter().find(|&&(k, l, x, returned)| {
            k == key && l == label && returned && execs[x].epoch <= epoch
        }) {
            self.violations.push(format!(
                "step {label} of key {key} ran again in exec {exec} (epoch {epoch}) after exec \
                 {first} (epoch {}) recorded it",
                self.execs[first].epoch
            ));
        }
        self.step_runs.push((key, label, exec, false));
        self.step_runs.len() - 1
    }
}

/// Runs step `label` of the body `exec`, noting when its closure runs and when `step`
/// returns a value the closure made (so it was recorded).
async fn model_step(
    model: &Arc<Mutex<Model>>,
    key: usize,
    exec: usize,
    label: &'static str,
) -> Result<(), ModelErr> {
    let ran = std::sync::OnceLock::new();
    step(label, || async {
        let _ = ran.set(model.lock().unwrap().step_starts(key, label, exec));
        Ok::<_, ModelErr>(exec)
    })
    .await?;
    if let Some(&run) = ran.get() {
        model.lock().unwrap().step_runs[run].3 = true;
    }
    Ok(())
}

/// Marks a body inactive however it ends, cancellation included.
struct Active(Arc<Mutex<Model>>, usize);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.lock().unwrap().execs[self.1].active = false;
    }
}

/// A store that injects faults: claims fail (before or after committing), renewals fail
/// once in a while and always for a stalled claim, records fail at most once in a row
/// per claim (or commit and lose their reply), releases fail.
struct Faulty {
    inner: Arc<dyn Store>,
    rng: Mutex<StdRng>,
    on: std::sync::atomic::AtomicBool,
    stalled: Mutex<HashSet<(OperationId, u64)>>,
    /// Claims whose last renewal or record failed: the next one goes through.
    renew_failed: Mutex<HashSet<(OperationId, u64)>>,
    record_failed: Mutex<HashSet<(OperationId, u64)>>,
    step_failed: Mutex<HashSet<(OperationId, u64)>>,
    /// When each claim's lease was last extended: the send time of its claim or of its
    /// latest successful renewal.
    leases: Mutex<Leases>,
}

fn fault(what: &str) -> StoreError {
    StoreError::new(
        true,
        std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            format!("injected: {what}"),
        ),
    )
}

impl Faulty {
    fn roll(&self, p: f64) -> bool {
        self.on.load(std::sync::atomic::Ordering::SeqCst) && self.rng.lock().unwrap().gen_bool(p)
    }

    /// Fails with probability `p`, never twice in a row for one claim.
    fn transient(
        &self,
        set: &Mutex<HashSet<(OperationId, u64)>>,
        id: &OperationId,
        epoch: u64,
        p: f64,
    ) -> bool {
        let k = (id.clone(), epoch);
        let mut set = set.lock().unwrap();
        if set.remove(&k) {
            return false;
        }
        if self.roll(p) {
            set.insert(k);
            return true;
        }
        false
    }
}

#[async_trait::async_trait]
impl Delegate for Faulty {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }
    // No read-only replay path: every call claims, and meets the claim's faults.
    async fn peek_completed(
        &self,
        _: &idem_runtime::OperationId,
        _: &[u8; 32],
    ) -> Result<
        Option<Result<idem_runtime::store::StoredOutcome, idem_runtime::store::Mismatched>>,
        StoreError,
    > {
        Ok(None)
    }
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        if self.roll(0.04) {
            return Err(fault("claim"));
        }
        let sent = Instant::now();
        let c = self.inner.claim(req).await?;
        if let Claim::Acquired { epoch, .. } = c {
            let answered = Instant::now();
            let mut leases = self.leases.lock().unwrap();
            let claimed = (req.id.clone(), epoch);
            leases.claims.insert(claimed.clone(), (sent, answered));
            leases
                .extended
                .entry(claimed)
                .or_default()
                .push((sent, answered));
        }
        // A reply in transit for a while: a caller may go away meanwhile.
        let transit = self
            .on
            .load(std::sync::atomic::Ordering::SeqCst)
            .then(|| self.rng.lock().unwrap().gen_range(0..4000u64))
            .filter(|us| *us > 1000);
        if let Some(us) = transit {
            tokio::time::sleep(Duration::from_micros(us)).await;
        }
        if self.roll(0.03) {
            if let Claim::Acquired { epoch, .. } = c {
                let claimed = (req.id.clone(), epoch);
                self.leases.lock().unwrap().lost_replies.insert(claimed);
            }
            return Err(fault("claim reply lost"));
        }
        Ok(c)
    }
    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        o: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        let claimed = (id.clone(), epoch);
        (self
            .leases
            .lock()
            .unwrap()
            .records
            .entry(claimed)
            .or_default())
        .push(Instant::now());
        if self.transient(&self.record_failed, id, epoch, 0.25) {
            return Err(fault("record"));
        }
        let f = self.inner.record(id, epoch, o, retain).await?;
        if self.transient(&self.record_failed, id, epoch, 0.05) {
            return Err(fault("record reply lost"));
        }
        Ok(f)
    }
    async fn record_step(
        &self,
        id: &OperationId,
        epoch: u64,
        label: &str,
        o: &StoredOutcome,
    ) -> Result<Fence, StoreError> {
        if self.transient(&self.step_failed, id, epoch, 0.1) {
            return Err(fault("record step"));
        }
        let f = self.inner.record_step(id, epoch, label, o).await?;
        if self.transient(&self.step_failed, id, epoch, 0.05) {
            return Err(fault("record step reply lost"));
        }
        Ok(f)
    }
    async fn release(
        &self,
        id: &OperationId,
        epoch: u64,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        if self.roll(0.05) {
            let claimed = (id.clone(), epoch);
            self.leases.lock().unwrap().failed_releases.insert(claimed);
            return Err(fault("release"));
        }
        self.inner.release(id, epoch, retain).await
    }
    async fn renew(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        if self.stalled.lock().unwrap().contains(&(id.clone(), epoch)) {
            return Err(fault("renew (stalled)"));
        }
        if self.transient(&self.renew_failed, id, epoch, 0.1) {
            return Err(fault("renew"));
        }
        let sent = Instant::now();
        let fence = self.inner.renew(id, epoch, lease).await?;
        if fence == Fence::Held {
            let answered = Instant::now();
            let mut leases = self.leases.lock().unwrap();
            let claimed = (id.clone(), epoch);
            leases
                .extended
                .entry(claimed)
                .or_default()
                .push((sent, answered));
        }
        Ok(fence)
    }
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        c: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        let fence = self.inner.resolve(id, epoch, c).await?;
        if fence == Fence::Held {
            // An operator's resolve ends every claim on the operation at once.
            self.leases
                .lock()
                .unwrap()
                .extended
                .retain(|(op, _), _| op != id);
        }
        Ok(fence)
    }
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Memory,
    SqliteFile,
    Redis,
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    MySql,
}

struct World {
    idem: Idem,
    faulty: Arc<Faulty>,
    model: Arc<Mutex<Model>>,
    _dir: Option<tempfile::TempDir>,
    /// The table or keys of this run, dropped after it passes.
    cleanup: Mutex<Option<common::Cleanup>>,
}

async fn world(backend: Backend, seed: u64) -> World {
    let slot: Arc<Mutex<Option<Arc<Faulty>>>> = Arc::default();
    let s = slot.clone();
    let builder = Idem::builder()
        .replay_cache_bytes(0)
        .poll_interval(Duration::from_millis(20))
        .layer(move |inner| {
            let f = Arc::new(Faulty {
                inner,
                rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x5eed)),
                on: true.into(),
                stalled: Mutex::default(),
                renew_failed: Mutex::default(),
                record_failed: Mutex::default(),
                step_failed: Mutex::default(),
                leases: Mutex::default(),
            });
            *s.lock().unwrap() = Some(f.clone());
            Arc::new(f as Arc<dyn Delegate>)
        });
    let mut cleanup = None;
    let (idem, dir) = match backend {
        Backend::Memory => (builder.memory(), None),
        Backend::Redis => {
            let prefix = common::unique_prefix(&format!("model_{seed}"));
            cleanup = Some(common::Cleanup::for_redis_prefix(&prefix));
            let idem = builder
                .key_prefix(prefix)
                .redis(&common::redis_url())
                .await
                .expect("open the Redis store");
            (idem, None)
        }
        #[cfg(feature = "postgres")]
        Backend::Postgres => {
            let table = common::unique_table(&format!("model_{seed}"));
            cleanup = Some(common::Cleanup::for_table(&table));
            let idem = builder
                .table(&table)
                .postgres(&common::postgres_url())
                .await
                .expect("open the PostgreSQL store");
            (idem, None)
        }
        #[cfg(feature = "mysql")]
        Backend::MySql => {
            let table = common::unique_table(&format!("model_{seed}"));
            cleanup = Some(common::Cleanup::for_mysql_table(&table));
            let idem = builder
                .table(table)
                .mysql(&common::mysql_url())
                .await
                .expect("open the MySQL store");
            (idem, None)
        }
        Backend::SqliteFile => {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}", dir.path().join("model.db").display());
            (builder.sqlite(&url).await.unwrap(), Some(dir))
        }
    };
    let faulty = slot.lock().unwrap().clone().unwrap();
    World {
        idem,
        faulty,
        model: Arc::default(),
        _dir: dir,
        cleanup: Mutex::new(cleanup),
    }
}

fn op_id(idem: &Idem, key: usize) -> OperationId {
    idem.operation("transfer", &(key as u64))
        .scope("model")
        .id()
        .clone()
}

/// The last key's lapsed claims go to UNKNOWN rather than run again, so a claim that
/// lapses without a body (one nobody released) shows as an UNKNOWN with no execution.
fn on_takeover(key: usize) -> idem_runtime::Takeover {
    if key == KEYS - 1 {
        idem_runtime::Takeover::Unknown
    } else {
        idem_runtime::Takeover::Rerun
    }
}

/// One call with the given behaviour; records its answer in the model. `early` is how
/// long a `CancelEarly` caller waits before it goes away.
async fn call(
    w: &World,
    key: usize,
    payload: u8,
    behavior: Behavior,
    reject: bool,
    early: Duration,
) {
    let generation = *w.model.lock().unwrap().generation.get(&key).unwrap_or(&0);
    let model = w.model.clone();
    let faulty = w.faulty.clone();
    let body = move || async move {
        let cur = current();
        let stall = behavior == Behavior::Stall;
        let id = OperationId {
            scope: cur.scope().to_owned(),
            name: cur.name().to_owned(),
            key: cur.key().to_owned(),
        };
        let exec = {
            let leases = faulty.leases.lock().unwrap();
            model.lock().unwrap().start(
                key,
                payload,
                id.clone(),
                cur.epoch(),
                stall,
                generation,
                &leases,
            )
        };
        let _active = Active(model.clone(), exec);
        model_step(&model, key, exec, "debit").await?;
        let nap = match behavior {
            Behavior::Slow => LEASE * 2,
            Behavior::Stall => {
                // A frozen process: its renewals stop while it sleeps past its lease.
                faulty.stalled.lock().unwrap().insert((id, cur.epoch()));
                LEASE * 3
            }
            Behavior::Cancel => LEASE * 10,
            _ => Duration::from_millis(5),
        };
        tokio::time::sleep(nap).await;
        model_step(&model, key, exec, "credit").await?;
        let out = match behavior {
            Behavior::Released => Err(ModelErr::Released),
            Behavior::Effect => Err(ModelErr::Effect),
            _ => Ok(exec),
        };
        model.lock().unwrap().execs[exec].body_ok = out.is_ok();
        out
    };
    let in_flight = if reject {
        InFlight::Reject
    } else {
        InFlight::Wait(LEASE * 2)
    };
    let fut = w
        .idem
        .operation("transfer", &(key as u64))
        .scope("model")
        .fingerprint(&payload)
        .retain(RETAIN)
        .lease(LEASE)
        .in_flight(in_flight)
        .on_takeover(on_takeover(key))
        .classify(classify)
        .run(body);
    let out = match behavior {
        Behavior::Cancel | Behavior::CancelEarly => {
            let after = if behavior == Behavior::Cancel {
                LEASE / 2
            } else {
                early
            };
            match tokio::time::timeout(after, fut).await {
                Ok(out) => out,
                Err(_) => return,
            }
        }
        _ => fut.await,
    };
    let mut m = w.model.lock().unwrap();
    match out {
        Ok(exec) => m.oks.push((key, payload, exec)),
        Err(ModelErr::Idem(IdemError::Fenced { epoch, .. })) => {
            let exec = m
                .execs
                .iter()
                .rposition(|e| e.key == key && e.epoch == epoch && e.payload == payload);
            match exec {
                Some(x) => m.fenced.push(x),
                None => m.fenced_unrun.push((key, epoch, generation)),
            }
        }
        Err(ModelErr::Idem(e @ IdemError::Unrecorded { .. })) => {
            let IdemError::Unrecorded { epoch, source, .. } = &e else {
                unreachable!()
            };
            let epoch = *epoch;
            let why = format!("{e}: {source}");
            if let Some(x) = m
                .execs
                .iter()
                .rposition(|e| e.key == key && e.epoch == epoch && e.payload == payload)
            {
                m.unrecorded.push((x, why));
            }
        }
        Err(_) => {}
    }
}

async fn operator(w: &World, key: usize, rng: &mut StdRng) {
    let id = op_id(&w.idem, key);
    let rows = match w.idem.list(&ListFilter::default().limit(1000)).await {
        Ok(rows) => rows,
        Err(_) => return,
    };
    let Some(row) = rows
        .into_iter()
        .find(|r| r.id == id && r.state != State::Completed)
    else {
        return;
    };
    // Only an operator's deliberate retry may let two bodies overlap; count it first.
    *w.model.lock().unwrap().generation.entry(key).or_default() += 1;
    if rng.gen_bool(0.5) || row.state == State::Unknown {
        let _ = w.idem.resolve(&id, row.epoch, Resolution::Retry).await;
    }
}

/// Two functions whose names default to one operation name: idem must never answer one
/// with the other's outcome (it refuses both with a `Config` error naming them).
mod twins {
    use idem_runtime::{Idem, IdemError, idempotent};

    pub mod stripe {
        use super::*;
        #[idempotent(store = idem, key = order, retain = "1h")]
        pub async fn refund(idem: &Idem, order: u64) -> Result<String, IdemError> {
            Ok("stripe".into())
        }
    }

    pub mod paypal {
        use super::*;
        #[idempotent(store = idem, key = order, retain = "1h")]
        pub async fn refund(idem: &Idem, order: u64) -> Result<String, IdemError> {
            Ok("paypal".into())
        }
    }
}

/// Calls one of the twins; a violation if it is answered with the other's outcome.
async fn twin(w: &World, key: usize, paypal: bool) {
    let (r, own) = if paypal {
        (twins::paypal::refund(&w.idem, key as u64).await, "paypal")
    } else {
        (twins::stripe::refund(&w.idem, key as u64).await, "stripe")
    };
    if let Ok(got) = r
        && got != own
    {
        w.model.lock().unwrap().violations.push(format!(
            "{own}::refund of order {key} was answered with {got}::refund's outcome"
        ));
    }
}

async fn run_seed(backend: Backend, seed: u64) {
    let w = Arc::new(world(backend, seed).await);
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let w = w.clone();
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(caller as u64));
        tasks.push(tokio::spawn(async move {
            for _ in 0..STEPS {
                let key = rng.gen_range(0..KEYS);
                let payload = if rng.gen_bool(0.8) { 0 } else { 1 };
                let roll = rng.gen_range(0..100);
                if roll < 70 {
                    let behavior = match rng.gen_range(0..100) {
                        0..40 => Behavior::Ok,
                        40..50 => Behavior::Slow,
                        50..70 => Behavior::Released,
                        70..75 => Behavior::Effect,
                        75..85 => Behavior::Stall,
                        85..95 => Behavior::CancelEarly,
                        _ => Behavior::Cancel,
                    };
                    let early = Duration::from_micros(rng.gen_range(0..4000));
                    call(&w, key, payload, behavior, rng.gen_bool(0.3), early).await;
                } else if roll < 80 {
                    operator(&w, key, &mut rng).await;
                } else if roll < 85 {
                    let _ = w.idem.purge_expired().await;
                } else if roll < 90 {
                    twin(&w, key, rng.gen_bool(0.5)).await;
                } else {
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(0..100))).await;
                }
            }
        }));
    }
    for t in tasks {
        if let Err(e) = t.await {
            panic!("seed {seed} on {backend:?}: a caller panicked: {e}");
        }
    }

    // Quiet period: no faults; every claimant is gone, so once its last lease has run
    // out no key may still be blocked (UNKNOWN waits for an operator by design). Two
    // leases: a renewal sent just before its caller went may land late on a loaded
    // machine and hold the key a full lease from then.
    w.faulty
        .on
        .store(false, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(LEASE * 2).await;
    let mut blocked = Vec::new();
    for key in 0..KEYS {
        for payload in [0u8, 1] {
            let r = w
                .idem
                .operation("transfer", &(key as u64))
                .scope("model")
                .fingerprint(&payload)
                .retain(RETAIN)
                .lease(LEASE)
                .in_flight(InFlight::Reject)
                .on_takeover(on_takeover(key))
                .classify(classify)
                .run(|| async { Ok::<usize, ModelErr>(usize::MAX) })
                .await;
            match r {
                Err(ModelErr::Idem(e @ IdemError::InFlight { .. })) => {
                    blocked.push(format!("key {key} payload {payload}: {e}"))
                }
                Ok(x) if x != usize::MAX => w.model.lock().unwrap().oks.push((key, payload, x)),
                _ => {}
            }
        }
    }

    // An UNKNOWN record names an attempt whose effect is in doubt: one whose body ran.
    // A claim whose caller went away before its body started is released, never parked.
    let unknown = w
        .idem
        .list(&ListFilter::unknown().limit(1000))
        .await
        .expect("list UNKNOWN records");

    let leases = std::mem::take(&mut *w.faulty.leases.lock().unwrap());
    // The guard lives in this block only, so no lock is held across the cleanup's awaits.
    let violations = {
        let m = w.model.lock().unwrap();
        let mut violations = m.violations.clone();
        violations.extend(
            blocked
                .into_iter()
                .map(|b| format!("blocked past one lease: {b}")),
        );
        for row in &unknown {
            let ran = m
                .execs
                .iter()
                .any(|e| e.op == row.id && e.epoch == row.epoch);
            let claimed = (row.id.clone(), row.epoch);
            let lost =
                leases.lost_replies.contains(&claimed) || leases.failed_releases.contains(&claimed);
            if !ran && !lost {
                violations.push(format!(
                    "{:?} is UNKNOWN at epoch {}, but no body ran at that epoch",
                    row.id, row.epoch
                ));
            }
        }
        let mut ok_exec: HashMap<usize, usize> = HashMap::new();
        for &(key, payload, exec) in &m.oks {
            let e = &m.execs[exec];
            if e.key != key || e.payload != payload || !e.body_ok {
                violations.push(format!(
                "key {key} payload {payload} was answered Ok with exec {exec}, which ran key {} \
                 payload {} (body ok: {})",
                e.key, e.payload, e.body_ok
            ));
            }
            if let Some(&first) = ok_exec.get(&key) {
                if first != exec {
                    violations.push(format!(
                    "key {key} answered Ok with the outcomes of two executions ({first} and {exec})"
                ));
                }
            } else {
                ok_exec.insert(key, exec);
            }
        }
        for &x in &m.fenced {
            let e = &m.execs[x];
            let reset = *m.generation.get(&e.key).unwrap_or(&0) != e.generation;
            if e.stalled || reset {
                continue;
            }
            let taker = leases.taker(&e.op, e.epoch);
            // The taker, and how long before the lease's end it was answered if it surely
            // was.
            match taker.map(|t| (t, leases.live_margin(&e.op, e.epoch, t))) {
                Some((t, Some(margin))) => violations.push(format!(
                    "exec {x} (key {}, epoch {}) was fenced by epoch {t}, claimed while its lease \
                 surely held ({margin:?} before its end)",
                    e.key, e.epoch,
                )),
                Some((_, None)) => {}
                None => violations.push(format!(
                    "exec {x} (key {}, epoch {}) was fenced though no later claim exists and no \
                 operator touched it",
                    e.key, e.epoch
                )),
            }
        }
        for &(key, epoch, generation) in &m.fenced_unrun {
            let reset = *m.generation.get(&key).unwrap_or(&0) != generation;
            if !reset && leases.taker(&op_id(&w.idem, key), epoch).is_none() {
                violations.push(format!(
                    "a call at epoch {epoch} of key {key} was fenced before its body though no \
                 later claim exists"
                ));
            }
        }
        for (x, why) in &m.unrecorded {
            let e = &m.execs[*x];
            let reset = *m.generation.get(&e.key).unwrap_or(&0) != e.generation;
            if e.stalled || reset {
                continue;
            }
            // Faults are never injected twice in a row, so one retry would have recorded it:
            // giving up without one is the defect, unless the lease was (nearly) gone.
            let claimed = (e.op.clone(), e.epoch);
            let attempts = leases.records.get(&claimed).map_or(&[][..], |v| &v[..]);
            let Some(&first) = attempts.first() else {
                continue;
            };
            let lease_left = leases
                .extended
                .get(&claimed)
                .into_iter()
                .flatten()
                .filter(|(_, answered)| *answered < first)
                .map(|(sent, _)| *sent + LEASE)
                .max()
                .is_some_and(|end| first + LEASE / 2 < end);
            if attempts.len() < 2 && lease_left {
                violations.push(format!(
                    "exec {x} (key {}, epoch {}) was reported Unrecorded after one attempt while \
                 its lease held ({why})",
                    e.key, e.epoch
                ));
            }
        }
        violations
    };
    assert!(
        violations.is_empty(),
        "model violations on {backend:?} with seed {seed} (rerun with IDEM_MODEL_SEED={seed}):\n{}",
        violations.join("\n")
    );
    let cleanup = w.cleanup.lock().unwrap().take();
    if let Some(cleanup) = cleanup {
        cleanup.run().await;
    }
}

/// Runs every seed on `backend` and says what ran, past the test harness's capture, so
/// CI's log shows the schedules and the seeds that reproduce them.
async fn run_seeds(backend: Backend, default_runs: u64) {
    let seeds = seeds(default_runs);
    for &seed in &seeds {
        run_seed(backend, seed).await;
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "model on {backend:?}: {} schedules of {CALLERS} callers x {STEPS} steps passed, \
         seeds {:?} (IDEM_MODEL_SEED=N replays one)",
        seeds.len(),
        seeds
    );
}

fn seeds(default_runs: u64) -> Vec<u64> {
    if let Ok(seed) = std::env::var("IDEM_MODEL_SEED") {
        return vec![seed.parse().expect("IDEM_MODEL_SEED is a number")];
    }
    let runs = std::env::var("IDEM_MODEL_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(default_runs);
    let base = std::env::var("IDEM_MODEL_BASE")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1);
    (base..base + runs).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_memory() {
    run_seeds(Backend::Memory, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_redis() {
    if common::redis_skip("model_redis").is_some() {
        return;
    }
    run_seeds(Backend::Redis, 4).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_postgres() {
    if common::postgres_skip("model_postgres").is_some() {
        return;
    }
    run_seeds(Backend::Postgres, 4).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_mysql() {
    if common::mysql_skip("model_mysql").is_some() {
        return;
    }
    run_seeds(Backend::MySql, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_sqlite_file() {
    run_seeds(Backend::SqliteFile, 4).await;
}
