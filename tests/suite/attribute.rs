//! The attribute end to end: each argument changes behaviour as documented.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{Disposition, Idem, IdemError, State, current, idempotent, observe};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;

suite!(
    method_with_self_store_replays,
    errors_record_replays_the_error,
    classify_decides_per_error,
    skipped_parameter_is_not_fingerprinted,
    fingerprint_none_binds_nothing,
    name_and_version_upgrade,
    downstream_key_is_stable_per_operation
);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Receipt {
    order: u64,
    cents: u64,
    attempt: usize,
}

struct Billing {
    idem: Idem,
    calls: AtomicUsize,
}

impl Billing {
    /// Doc comments and visibility survive the attribute.
    #[idempotent(store = self.idem, key = order, scope = tenant, retain = "1h")]
    pub async fn charge(&self, tenant: &str, order: u64, cents: u64) -> Result<Receipt, AppError> {
        let attempt = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if cents == 0 {
            return Err(AppError::Declined("zero amount".into()));
        }
        Ok(Receipt {
            order,
            cents,
            attempt,
        })
    }
}

async fn method_with_self_store_replays(ctx: Ctx) {
    let billing = Billing {
        idem: ctx.idem.clone(),
        calls: AtomicUsize::new(0),
    };
    let (first, info) = observe(billing.charge("acme", 1, 500)).await;
    assert!(!info.replayed());
    let (again, info) = observe(billing.charge("acme", 1, 500)).await;
    assert!(info.replayed());
    assert_eq!(first, again);
    // Another tenant is another operation; another amount under the same key is refused.
    assert_eq!(billing.charge("globex", 1, 500).await.unwrap().attempt, 2);
    let r = billing.charge("acme", 1, 900).await;
    assert!(
        matches!(&r, Err(AppError::Idem(m)) if m.contains("different payload")),
        "{r:?}"
    );
    // A released error (the default) runs again.
    assert!(billing.charge("acme", 2, 0).await.is_err());
    assert!(billing.charge("acme", 2, 0).await.is_err());
    assert_eq!(billing.calls.load(Ordering::SeqCst), 4);
}

/// The keys `refund` ran for: each backend's test runs at once with the others', so
/// each counts its own key's runs.
static RECORDED_RUNS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn recorded_runs(key: &str) -> usize {
    let runs = RECORDED_RUNS.lock().unwrap();
    runs.iter().filter(|k| *k == key).count()
}

// Named: `model` has functions that default to `refund` and `transfer` in this binary.
#[idempotent(store = idem, name = "recorded_refund", key = id, retain = "10m", errors = record)]
async fn refund(idem: &Idem, id: &str) -> Result<u32, AppError> {
    RECORDED_RUNS.lock().unwrap().push(id.to_owned());
    Err(AppError::Declined(format!("refund {id} refused")))
}

async fn errors_record_replays_the_error(ctx: Ctx) {
    let key = format!("r-{:?}", ctx.backend);
    let first = refund(&ctx.idem, &key).await;
    let second = refund(&ctx.idem, &key).await;
    assert_eq!(first, second);
    assert!(matches!(first, Err(AppError::Declined(_))));
    assert_eq!(recorded_runs(&key), 1);
}

fn by_kind(e: &AppError) -> Disposition {
    match e {
        AppError::Declined(_) => Disposition::Record,
        AppError::Timeout => Disposition::Unknown,
        AppError::Idem(_) => Disposition::Release,
    }
}

#[idempotent(
    store = idem,
    name = "classified_transfer",
    key = (account, seq),
    retain = "10m",
    classify = by_kind
)]
async fn transfer(idem: &Idem, account: &str, seq: u32, outcome: &str) -> Result<u32, AppError> {
    match outcome {
        "timeout" => Err(AppError::Timeout),
        "declined" => Err(AppError::Declined("insufficient funds".into())),
        _ => Ok(seq),
    }
}

async fn classify_decides_per_error(ctx: Ctx) {
    let idem = &ctx.idem;
    assert_eq!(
        transfer(idem, "a", 1, "declined").await,
        Err(AppError::Declined("insufficient funds".into()))
    );
    // Recorded: replayed even though the fingerprint's `outcome` is the same.
    assert_eq!(
        transfer(idem, "a", 1, "declined").await,
        Err(AppError::Declined("insufficient funds".into()))
    );
    assert_eq!(
        transfer(idem, "a", 2, "timeout").await,
        Err(AppError::Timeout)
    );
    let r = transfer(idem, "a", 2, "timeout").await;
    assert!(
        matches!(&r, Err(AppError::Idem(m)) if m.contains("UNKNOWN")),
        "{r:?}"
    );
}

static NOTIFY_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(store = idem, key = user, retain = "1d", in_flight = reject)]
async fn notify(idem: &Idem, user: u64, #[idem(skip)] sent_at: u64) -> Result<u64, IdemError> {
    NOTIFY_RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(sent_at)
}

async fn skipped_parameter_is_not_fingerprinted(ctx: Ctx) {
    let user = 1000 + ctx.backend as u64;
    let first = notify(&ctx.idem, user, 1).await.unwrap();
    // A different delivery timestamp is the same intent: replayed, not a mismatch.
    assert_eq!(notify(&ctx.idem, user, 2).await.unwrap(), first);
}

#[idempotent(store = idem, key = id, retain = "1d", fingerprint = none, name = "ingest_event")]
async fn ingest(idem: &Idem, id: u64, payload: &str) -> Result<String, IdemError> {
    Ok(format!("{}:{payload}", current().name()))
}

async fn fingerprint_none_binds_nothing(ctx: Ctx) {
    assert_eq!(ingest(&ctx.idem, 5, "a").await.unwrap(), "ingest_event:a");
    assert_eq!(ingest(&ctx.idem, 5, "b").await.unwrap(), "ingest_event:a");
}

#[idempotent(store = idem, key = id, retain = "1d", name = "price")]
async fn price_v1(idem: &Idem, id: u64) -> Result<u64, IdemError> {
    Ok(id * 100)
}

fn cents_to_money(from: u32, old: serde_json::Value) -> Result<(u64, String), IdemError> {
    assert_eq!(from, 1);
    Ok((old.as_u64().unwrap_or_default(), "EUR".into()))
}

#[idempotent(store = idem, key = id, retain = "1d", name = "price", version = 2, upgrade = cents_to_money)]
async fn price_v2(idem: &Idem, id: u64) -> Result<(u64, String), IdemError> {
    Ok((id, "USD".into()))
}

#[idempotent(store = idem, key = id, retain = "1d", name = "price", version = 2)]
async fn price_v2_no_upgrade(idem: &Idem, id: u64) -> Result<(u64, String), IdemError> {
    Ok((id, "USD".into()))
}

async fn name_and_version_upgrade(ctx: Ctx) {
    assert_eq!(price_v1(&ctx.idem, 3).await.unwrap(), 300);
    assert_eq!(price_v2(&ctx.idem, 3).await.unwrap(), (300, "EUR".into()));
    let r = price_v2_no_upgrade(&ctx.idem, 3).await;
    assert!(
        matches!(&r, Err(IdemError::Codec { message, .. }) if message.contains("version 1")),
        "{r:?}"
    );
}

#[idempotent(store = idem, key = id, retain = "1d")]
async fn ship(idem: &Idem, id: u64, carrier: &str) -> Result<String, IdemError> {
    let cur = current();
    // Epochs are unique per store and never 0 (0 marks an unprotected fail-open run).
    assert!(cur.epoch() >= 1);
    assert!(idem_runtime::try_current().is_some());
    // Not visible in tasks the body spawns.
    let spawned = tokio::spawn(async { idem_runtime::try_current().is_none() })
        .await
        .unwrap();
    assert!(spawned);
    Ok(cur.downstream_key(carrier))
}

async fn downstream_key_is_stable_per_operation(ctx: Ctx) {
    let a = ship(&ctx.idem, 1, "ups").await.unwrap();
    let b = ship(&ctx.idem, 2, "ups").await.unwrap();
    assert_ne!(a, b);
    assert_eq!(a.len(), 64);
    assert!(idem_runtime::try_current().is_none());
}

static RESERVE_STARTED: Notify = Notify::const_new();

/// A body that never finishes on its own, so its caller can cancel it once it started.
#[idempotent(store = idem, tx = tx, key = order, retain = "1d", lease = "2s")]
async fn reserve(
    idem: &Idem,
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    order: &str,
) -> Result<u64, AppError> {
    RESERVE_STARTED.notify_one();
    std::future::pending().await
}

/// `lease` in transactional mode bounds how long a claim abandoned in a committed
/// transaction (its body cancelled) holds the key: 2 s here, not the 60 s default.
#[tokio::test]
async fn tx_lease_bounds_a_claim_left_by_a_cancelled_body() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("lease.db").display()
    );
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let idem = Idem::from_pool(pool.clone()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    {
        let call = reserve(&idem, &mut tx, "o-1");
        tokio::pin!(call);
        tokio::select! {
            _ = RESERVE_STARTED.notified() => {}
            r = &mut call => panic!("the body cannot finish: {r:?}"),
        }
        // Dropped here: the body is cancelled after its claim.
    }
    tx.commit().await.unwrap();
    let id = idem.operation("reserve", "o-1").id().clone();
    let record = idem
        .get(&id)
        .await
        .unwrap()
        .expect("the claim was committed");
    assert_eq!(record.info.state, State::InProgress);
    // By the store's clock: at most the 2 s given, whatever the time since the claim.
    let remaining = record
        .lease_remaining
        .expect("an IN_PROGRESS record has a lease");
    assert!(
        remaining <= Duration::from_secs(2),
        "the claim holds its key for {remaining:?} more, not within the `lease = \"2s\"` given"
    );
}
