//! Encrypted outcomes (`IdemBuilder::encrypt`): on every store what is stored of an
//! outcome, a recorded error and a step value is sealed, never the clear JSON, and
//! replays through the keyring; keys rotate across a restart; a ciphertext moved onto
//! another record, or under a key the keyring lacks, is refused and never replayed;
//! records from before encryption still replay; transactional mode seals too.
use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Backend, Counter, Ctx};
use idem_runtime::store::MemoryStore;
use idem_runtime::{Idem, IdemError, Keyring, OpenFailure, OperationId, step};
use serde::{Deserialize, Serialize};

const KEY_A: [u8; 32] = [0xa1; 32];
const KEY_B: [u8; 32] = [0xb2; 32];
/// What must never be found in a store in clear.
const PAN: &str = "PAN-4242-4242-SECRET";

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    card: String,
    cents: u64,
}

fn receipt(cents: u64) -> Receipt {
    Receipt {
        card: PAN.into(),
        cents,
    }
}

fn only_a() -> Keyring {
    Keyring::new("a", KEY_A).unwrap()
}

fn b_then_a() -> Keyring {
    Keyring::new("b", KEY_B)
        .unwrap()
        .with_retired("a", KEY_A)
        .unwrap()
}

fn only_b() -> Keyring {
    Keyring::new("b", KEY_B).unwrap()
}

fn charge_op(idem: &Idem, key: &str) -> idem_runtime::NewOperation {
    idem.operation("charge", key).scope("tenant-a")
}

fn id(idem: &Idem, key: &str) -> OperationId {
    charge_op(idem, key).id().clone()
}

async fn charge(idem: &Idem, key: &str, cents: u64, runs: &Counter) -> Result<Receipt, IdemError> {
    charge_op(idem, key)
        .retain(Duration::from_secs(3600))
        .fingerprint(&cents)
        .run(|| async move {
            runs.hit();
            Ok::<_, IdemError>(receipt(cents))
        })
        .await
}

/// The outcome as the store holds it, read through a handle without the keyring (which
/// opens nothing).
async fn stored_body(plain: &Idem, key: &str) -> Vec<u8> {
    let detail = plain.get(&id(plain, key)).await.unwrap().expect("recorded");
    detail.outcome.expect("completed").body.to_vec()
}

fn assert_sealed(store: &str, body: &[u8], key_id: &str) {
    let clear = serde_json::to_vec(&receipt(1999)).unwrap();
    assert_eq!(body.first(), Some(&0u8), "{store}: not sealed: {body:?}");
    assert_ne!(body, &clear[..], "{store}: the clear JSON was stored");
    let holds = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    assert!(
        !holds(PAN.as_bytes()),
        "{store}: the card number is in clear"
    );
    assert!(!holds(b"cents"), "{store}: a field name is in clear");
    let shown = idem_runtime::store::StoredOutcome::new(body.to_vec(), false, 1);
    assert_eq!(shown.sealed_key_id().as_deref(), Some(key_id), "{store}");
}

/// Two handles on one store: one encrypting under `keys`, one without a keyring.
struct Handles {
    enc: Idem,
    plain: Idem,
}

async fn handles(ctx: &Ctx, memory: &Arc<MemoryStore>, keys: Keyring) -> Handles {
    if ctx.backend == Backend::Memory {
        return Handles {
            enc: Idem::builder().encrypt(keys).store(memory.clone()),
            plain: Idem::builder().store(memory.clone()),
        };
    }
    Handles {
        enc: ctx.variant(|b| b.encrypt(keys.clone())).await,
        plain: ctx.variant(|b| b).await,
    }
}

/// On every store: the stored outcome and step values are sealed (not the JSON, not
/// containing it), the keyring replays them, a handle without it is refused naming the
/// key and runs nothing.
#[tokio::test]
async fn outcomes_and_steps_are_sealed_on_every_store() {
    let test = "outcomes_and_steps_are_sealed_on_every_store";
    for backend in [
        Backend::Memory,
        Backend::Sqlite,
        Backend::Postgres,
        Backend::MySql,
        Backend::Redis,
    ] {
        let Some(ctx) = Ctx::open(backend, test).await else {
            continue;
        };
        let store = format!("{backend:?}");
        let memory = Arc::new(MemoryStore::default());
        let h = handles(&ctx, &memory, only_a()).await;
        let runs = Counter::default();
        assert_eq!(
            charge(&h.enc, "o1", 1999, &runs).await.unwrap(),
            receipt(1999)
        );
        assert_sealed(&store, &stored_body(&h.plain, "o1").await, "a");
        // Replayed through the keyring by another handle (no cache in front).
        let again = ctx_handle(&ctx, &memory, only_a()).await;
        assert_eq!(
            charge(&again, "o1", 1999, &runs).await.unwrap(),
            receipt(1999)
        );
        assert_eq!(runs.get(), 1, "{store}: the body ran again");
        // Without the keyring: refused, naming the key, never replayed as text.
        match charge(&h.plain, "o1", 1999, &runs).await {
            Err(IdemError::Undecryptable {
                key_id,
                reason: OpenFailure::NoKeyring,
                ..
            }) => assert_eq!(key_id, "a", "{store}"),
            other => panic!("{store}: {other:?}"),
        }
        assert_eq!(runs.get(), 1, "{store}: the body ran without the keyring");

        // A step's value, kept while its operation is released, is sealed too.
        let step_runs = Counter::default();
        let checkout = |idem: Idem, fail: bool| {
            let step_runs = &step_runs;
            async move {
                charge_op(&idem, "s1")
                    .retain(Duration::from_secs(3600))
                    .fingerprint_none()
                    .run(|| async move {
                        let paid: Receipt = step("pay", || async {
                            step_runs.hit();
                            Ok::<_, IdemError>(receipt(1999))
                        })
                        .await?;
                        if fail {
                            return Err(IdemError::Config {
                                message: "mail down".into(),
                            });
                        }
                        Ok(paid)
                    })
                    .await
            }
        };
        assert!(checkout(h.enc.clone(), true).await.is_err());
        let detail = h.plain.get(&id(&h.plain, "s1")).await.unwrap().unwrap();
        assert_eq!(detail.steps.len(), 1, "{store}");
        assert_sealed(&store, &detail.steps[0].outcome.body, "a");
        // The keyring's `get` opens it for an operator.
        let opened = h.enc.get(&id(&h.enc, "s1")).await.unwrap().unwrap();
        let value: Receipt = serde_json::from_slice(&opened.steps[0].outcome.body).unwrap();
        assert_eq!(value, receipt(1999), "{store}");
        // Resumed: the step replays from its sealed value rather than running again.
        assert_eq!(checkout(h.enc.clone(), false).await.unwrap(), receipt(1999));
        assert_eq!(step_runs.get(), 1, "{store}: the step ran again");
        assert_sealed(&store, &stored_body(&h.plain, "s1").await, "a");
        ctx.cleanup().run().await;
    }
}

async fn ctx_handle(ctx: &Ctx, memory: &Arc<MemoryStore>, keys: Keyring) -> Idem {
    handles(ctx, memory, keys).await.enc
}

/// A SQLite file, reopened as a restarted process would.
struct SqliteFile {
    _dir: tempfile::TempDir,
    url: String,
}

impl SqliteFile {
    fn new() -> SqliteFile {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        SqliteFile { _dir: dir, url }
    }

    async fn open(&self, keys: Option<Keyring>) -> Idem {
        let b = Idem::builder().replay_cache_bytes(0);
        let b = match keys {
            Some(keys) => b.encrypt(keys),
            None => b,
        };
        b.sqlite(&self.url).await.unwrap()
    }
}

/// Written under A; after a restart with B current and A retired, it replays and new
/// writes use B; after a restart with B only, the A record is refused naming A while
/// the B record replays.
#[tokio::test]
async fn keys_rotate_across_a_restart() {
    let file = SqliteFile::new();
    let runs = Counter::default();
    let first = file.open(Some(only_a())).await;
    charge(&first, "o1", 1999, &runs).await.unwrap();
    drop(first);

    let rotated = file.open(Some(b_then_a())).await;
    let plain = file.open(None).await;
    assert_eq!(
        charge(&rotated, "o1", 1999, &runs).await.unwrap(),
        receipt(1999)
    );
    assert_eq!(runs.get(), 1, "the A record did not replay");
    charge(&rotated, "o2", 1999, &runs).await.unwrap();
    assert_sealed("sqlite", &stored_body(&plain, "o1").await, "a");
    assert_sealed("sqlite", &stored_body(&plain, "o2").await, "b");
    drop(rotated);

    let only = file.open(Some(only_b())).await;
    match charge(&only, "o1", 1999, &runs).await {
        Err(
            e @ IdemError::Undecryptable {
                reason: OpenFailure::UnknownKey,
                ..
            },
        ) => {
            assert!(e.to_string().contains("key `a`"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        charge(&only, "o2", 1999, &runs).await.unwrap(),
        receipt(1999)
    );
    assert_eq!(runs.get(), 2, "a refused record ran its body");
}

/// The stored outcome of `from` copied onto `to`'s record with SQL: `to` is refused (it
/// fails authentication under its key) and its body does not run.
async fn swapped_is_refused(store: &str, idem: &Idem, swap: impl AsyncFnOnce(&str, &str)) {
    let runs = Counter::default();
    charge(idem, "o1", 1999, &runs).await.unwrap();
    charge(idem, "o2", 1999, &runs).await.unwrap();
    let (from, to) = (id(idem, "o1").key, id(idem, "o2").key);
    swap(&from, &to).await;
    match charge(idem, "o2", 1999, &runs).await {
        Err(IdemError::Undecryptable {
            key_id,
            reason: OpenFailure::Unauthentic,
            ..
        }) => assert_eq!(key_id, "a", "{store}"),
        other => panic!("{store}: the swapped ciphertext was answered: {other:?}"),
    }
    assert_eq!(
        charge(idem, "o1", 1999, &runs).await.unwrap(),
        receipt(1999)
    );
    assert_eq!(runs.get(), 2, "{store}: a body ran again");
}

/// A ciphertext copied from one record onto another is refused, on SQLite and PostgreSQL.
#[tokio::test]
async fn a_ciphertext_moved_to_another_record_is_refused() {
    let test = "a_ciphertext_moved_to_another_record_is_refused";
    let file = SqliteFile::new();
    let idem = file.open(Some(only_a())).await;
    let pool = sqlx::SqlitePool::connect(&file.url).await.unwrap();
    swapped_is_refused("sqlite", &idem, async |from, to| {
        sqlx::query(
            "UPDATE idem_operations SET outcome = \
             (SELECT outcome FROM idem_operations WHERE key = ?1) WHERE key = ?2",
        )
        .bind(from)
        .bind(to)
        .execute(&pool)
        .await
        .unwrap();
    })
    .await;
    pool.close().await;

    #[cfg(feature = "postgres")]
    if common::postgres_skip(test).is_none() {
        let (url, table) = (common::postgres_url(), common::unique_table(test));
        let idem = Idem::builder()
            .encrypt(only_a())
            .replay_cache_bytes(0)
            .table(table.clone())
            .postgres(&url)
            .await
            .unwrap();
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        swapped_is_refused("postgres", &idem, async |from, to| {
            sqlx::query(&format!(
                "UPDATE {table} SET outcome = (SELECT outcome FROM {table} WHERE key = $1) \
                 WHERE key = $2"
            ))
            .bind(from)
            .bind(to)
            .execute(&pool)
            .await
            .unwrap();
        })
        .await;
        pool.close().await;
        common::Cleanup::for_table(&table).run().await;
    }
    #[cfg(not(feature = "postgres"))]
    let _ = test;
}

/// A record stored in clear before encryption was turned on still replays; new ones are
/// sealed.
#[tokio::test]
async fn a_clear_record_from_before_encryption_still_replays() {
    let file = SqliteFile::new();
    let runs = Counter::default();
    let before = file.open(None).await;
    charge(&before, "o1", 1999, &runs).await.unwrap();
    let clear = stored_body(&before, "o1").await;
    assert_eq!(clear, serde_json::to_vec(&receipt(1999)).unwrap());
    drop(before);
    let after = file.open(Some(only_a())).await;
    assert_eq!(
        charge(&after, "o1", 1999, &runs).await.unwrap(),
        receipt(1999)
    );
    assert_eq!(runs.get(), 1, "the clear record did not replay");
    charge(&after, "o2", 1999, &runs).await.unwrap();
    let plain = file.open(None).await;
    assert_sealed("sqlite", &stored_body(&plain, "o2").await, "a");
}

/// Transactional mode seals its record in the caller's transaction, and replays it.
#[tokio::test]
async fn transactional_mode_seals_its_record() {
    let file = SqliteFile::new();
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}?mode=rwc", file.url))
        .await
        .unwrap();
    let idem = Idem::builder()
        .encrypt(only_a())
        .replay_cache_bytes(0)
        .pool(pool.clone())
        .await
        .unwrap();
    let runs = Counter::default();
    for _ in 0..2 {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        let op = charge_op(&idem, "t1")
            .retain(Duration::from_secs(3600))
            .fingerprint(&1999u64);
        let out = match op.begin_tx::<_, Receipt, IdemError>(&mut tx).await.unwrap() {
            idem_runtime::TxStep::Replay(outcome) => outcome.unwrap(),
            idem_runtime::TxStep::Run(guard) => {
                let out = guard
                    .body(async {
                        runs.hit();
                        Ok::<_, IdemError>(receipt(1999))
                    })
                    .await;
                guard.finish(&mut tx, out).await.unwrap()
            }
        };
        tx.commit().await.unwrap();
        assert_eq!(out, receipt(1999));
    }
    assert_eq!(runs.get(), 1, "the transactional body ran twice");
    let body: Vec<u8> = sqlx::query_scalar("SELECT outcome FROM idem_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_sealed("sqlite tx", &body, "a");
}

/// The HTTP layer's recorded response is an outcome: sealed in the store, replayed
/// through the keyring, and answered `500` (the handler not run) by a server whose
/// keyring lacks its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_responses_are_sealed_and_an_unreadable_one_is_a_500() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let file = SqliteFile::new();
    let serve = |idem: Idem| async move {
        let router = axum::Router::new()
            .route(
                "/pay",
                axum::routing::post(|| async {
                    RUNS.fetch_add(1, Ordering::SeqCst);
                    axum::Json(receipt(1999))
                }),
            )
            .route_layer(idem_runtime::http::IdempotencyLayer::new(idem))
            .layer(axum::middleware::from_fn(
                |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
                    let alice = idem_runtime::http::Principal::new("alice");
                    req.extensions_mut().insert(alice);
                    next.run(req).await
                },
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/pay", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        url
    };
    let post = |url: String| async move {
        let r = reqwest::Client::new()
            .post(&url)
            .header("idempotency-key", "k-1")
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    let url = serve(file.open(Some(only_a())).await).await;
    let first = post(url.clone()).await;
    assert_eq!(first.0, 200, "{first:?}");
    assert!(first.1.contains(PAN), "{first:?}");
    assert_eq!(post(url).await, first, "the replay differs");
    assert_eq!(RUNS.load(Ordering::SeqCst), 1, "the handler ran again");

    let pool = sqlx::SqlitePool::connect(&file.url).await.unwrap();
    let body: Vec<u8> = sqlx::query_scalar("SELECT outcome FROM idem_operations")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(body.first(), Some(&0u8), "the response is not sealed");
    assert!(!body.windows(PAN.len()).any(|w| w == PAN.as_bytes()));

    let url = serve(file.open(Some(only_b())).await).await;
    let refused = post(url).await;
    assert_eq!(refused.0, 500, "{refused:?}");
    assert!(!refused.1.contains(PAN), "{refused:?}");
    assert_eq!(
        RUNS.load(Ordering::SeqCst),
        1,
        "the handler ran on an unreadable record"
    );
}
