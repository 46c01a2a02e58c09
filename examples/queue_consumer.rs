//! A NATS JetStream consumer that applies each "payment requested" message once,
//! however often the broker delivers it.
//!
//! Needs a NATS server with JetStream (`nats-server -js`), at `IDEM_NATS_URL`
//! (default `nats://127.0.0.1:4222`). Run:
//!
//! ```sh
//! cargo run -p idem-tests --example queue_consumer -- --produce 100      # publish 100 messages
//! cargo run -p idem-tests --example queue_consumer -- --exit-when-idle 5 # consume; stop when idle 5 s
//! sqlite3 queue_consumer.db 'SELECT count(*) FROM payments'              # one row per payment
//! ```
//!
//! Messages on subject `payments.requested` (stream `PAYMENTS`, created if missing)
//! carry `{"payment_id": "<string>", "amount_cents": <int>}`. The handler is keyed by
//! `payment_id`, never by the delivery's sequence number, and runs in transactional
//! mode: its `payments` row and idem's record commit together, and the message is acked
//! only after that commit. Redeliveries and producer republishes replay; a payment id
//! reused with another amount is terminated with an alert. The database is the SQLite
//! file `IDEM_EXAMPLE_DB` (default `./queue_consumer.db`), or PostgreSQL when
//! `IDEM_POSTGRES_URL` is set.
//!
//! The consumer pulls batches of up to `--batch` messages (default 10) and runs them
//! concurrently with `Policy::run_batch`, which answers each message on its own: in one
//! batch, a payment that failed is redelivered and a reused id terminated while the
//! others are acked. Every message's verdict is printed on stdout as one line,
//! `verdict payment_id=<id> delivery=<n> cause=<Cause> action=<Action>`.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use clap::Parser;
use futures_util::StreamExt;
use idem_runtime::queue::{Action, AsIdemError, Policy};
use idem_runtime::{Idem, IdemError, TxConnection, idempotent};
use serde::{Deserialize, Serialize};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Consume (or, with `--produce`, publish) "payment requested" messages.
#[derive(Parser, Debug)]
struct Args {
    /// The NATS server.
    #[arg(long, env = "IDEM_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// The JetStream stream, created if missing.
    #[arg(long, default_value = "PAYMENTS")]
    stream: String,
    /// The subject payments are requested on.
    #[arg(long, default_value = "payments.requested")]
    subject: String,
    /// The durable consumer's name.
    #[arg(long, default_value = "payments-consumer")]
    consumer: String,
    /// How long the broker waits for an ack before redelivering, in seconds.
    #[arg(long, default_value_t = 30)]
    ack_wait: u64,
    /// Exit after this many seconds with nothing to consume.
    #[arg(long, value_name = "SECS")]
    exit_when_idle: Option<u64>,
    /// Pull and handle up to this many messages at once.
    #[arg(long, default_value_t = 10)]
    batch: usize,
    /// Publish this many test messages (`p-1` … `p-N`) instead of consuming.
    #[arg(long, value_name = "N")]
    produce: Option<u64>,
}

/// The message payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PaymentRequested {
    payment_id: String,
    amount_cents: i64,
}

/// What the handler records and replays.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Applied {
    payment_id: String,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum ConsumerError {
    #[error("ledger unavailable: {0}")]
    Ledger(String),
    #[error(transparent)]
    Idem(#[from] IdemError),
}

impl AsIdemError for ConsumerError {
    fn as_idem_error(&self) -> Option<&IdemError> {
        match self {
            ConsumerError::Idem(e) => Some(e),
            ConsumerError::Ledger(_) => None,
        }
    }
}

/// The effect: one row in `payments`, written through the caller's transaction.
trait Ledger: TxConnection {
    async fn insert_payment(&mut self, p: &PaymentRequested) -> Result<(), sqlx::Error>;
}

impl Ledger for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn insert_payment(&mut self, p: &PaymentRequested) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO payments (payment_id, amount_cents) VALUES (?1, ?2)")
            .bind(&p.payment_id)
            .bind(p.amount_cents)
            .execute(&mut **self)
            .await
            .map(drop)
    }
}

#[cfg(feature = "postgres")]
impl Ledger for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn insert_payment(&mut self, p: &PaymentRequested) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO payments (payment_id, amount_cents) VALUES ($1, $2)")
            .bind(&p.payment_id)
            .bind(p.amount_cents)
            .execute(&mut **self)
            .await
            .map(drop)
    }
}

/// Payment ids whose first attempt fails with a transient ledger error, from
/// `QUEUE_CONSUMER_FLAKY` (comma-separated): a released error, redelivered and retried.
fn fail_once(payment_id: &str) -> bool {
    static FAILED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let flaky = std::env::var("QUEUE_CONSUMER_FLAKY").unwrap_or_default();
    if !flaky.split(',').any(|id| id == payment_id) {
        return false;
    }
    FAILED
        .lock()
        .unwrap()
        .get_or_insert_with(HashSet::new)
        .insert(payment_id.to_string())
}

#[idempotent(store = idem, tx = tx, key = msg.payment_id, fingerprint = msg, retain = "7d")]
async fn apply_payment<C: Ledger>(
    idem: &Idem,
    tx: &mut C,
    msg: &PaymentRequested,
) -> Result<Applied, ConsumerError> {
    if fail_once(&msg.payment_id) {
        return Err(ConsumerError::Ledger("timed out".into()));
    }
    tx.insert_payment(msg)
        .await
        .map_err(|e| ConsumerError::Ledger(e.to_string()))?;
    Ok(Applied {
        payment_id: msg.payment_id.clone(),
        amount_cents: msg.amount_cents,
    })
}

/// The application database: the payments table and idem's records, side by side.
enum Db {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
}

impl Db {
    async fn open() -> Result<(Db, Idem), BoxError> {
        #[cfg(feature = "postgres")]
        if let Ok(url) = std::env::var("IDEM_POSTGRES_URL") {
            let pool = sqlx::PgPool::connect(&url).await?;
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS payments (payment_id TEXT NOT NULL, \
                 amount_cents BIGINT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            )
            .execute(&pool)
            .await?;
            let idem = Idem::from_pool(pool.clone()).await?;
            return Ok((Db::Postgres(pool), idem));
        }
        let path = std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "queue_consumer.db".into());
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        // No unique constraint on purpose: a duplicate effect would show as a second row.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS payments (payment_id TEXT NOT NULL, \
             amount_cents INTEGER NOT NULL, applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
        )
        .execute(&pool)
        .await?;
        let idem = Idem::from_pool(pool.clone()).await?;
        Ok((Db::Sqlite(pool), idem))
    }

    /// Applies one message in its own transaction, committed before the caller acks.
    async fn apply(&self, idem: &Idem, msg: &PaymentRequested) -> Result<Applied, ConsumerError> {
        // A failed begin or commit loses the claim and the effect together: the store's
        // error, so the message is redelivered even when the handler said it recorded.
        let store_err = |e: sqlx::Error| {
            ConsumerError::Idem(IdemError::Store {
                during: "commit",
                retryable: true,
                source: e.into(),
            })
        };
        match self {
            Db::Sqlite(pool) => {
                // SQLite has no row locks: take the write lock first so a duplicate waits.
                let mut tx = pool
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(store_err)?;
                let out = apply_payment(idem, &mut tx, msg).await;
                tx.commit().await.map_err(store_err)?;
                out
            }
            #[cfg(feature = "postgres")]
            Db::Postgres(pool) => {
                let mut tx = pool.begin().await.map_err(store_err)?;
                let out = apply_payment(idem, &mut tx, msg).await;
                tx.commit().await.map_err(store_err)?;
                out
            }
        }
    }
}

async fn produce(js: &jetstream::Context, subject: &str, n: u64) -> Result<(), BoxError> {
    for i in 1..=n {
        let msg = PaymentRequested {
            payment_id: format!("p-{i}"),
            amount_cents: 100 * i as i64,
        };
        js.publish(subject.to_string(), serde_json::to_vec(&msg)?.into())
            .await?
            .await?;
    }
    println!("published {n} messages to {subject}");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let client = async_nats::connect(&args.nats).await?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: args.stream.clone(),
            subjects: vec![args.subject.clone()],
            ..Default::default()
        })
        .await?;
    if let Some(n) = args.produce {
        return produce(&js, &args.subject, n).await;
    }

    let consumer = stream
        .get_or_create_consumer(
            &args.consumer,
            pull::Config {
                durable_name: Some(args.consumer.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(args.ack_wait),
                ..Default::default()
            },
        )
        .await?;
    let (db, idem) = Db::open().await?;
    let policy = Policy::default();
    let mut last_message = Instant::now();
    loop {
        // Up to `--batch` messages, or what arrived within a second.
        let mut pulled = consumer
            .batch()
            .max_messages(args.batch.max(1))
            .expires(Duration::from_secs(1))
            .messages()
            .await?;
        let mut batch = Vec::new();
        while let Some(message) = pulled.next().await {
            let message = message?;
            let Ok(request) = serde_json::from_slice::<PaymentRequested>(&message.payload) else {
                tracing::error!(subject = %message.subject, "undecodable payment message; terminating it");
                message.ack_with(AckKind::Term).await?;
                continue;
            };
            batch.push((message, request));
        }
        if batch.is_empty() {
            match args.exit_when_idle {
                Some(secs) if last_message.elapsed() >= Duration::from_secs(secs) => break,
                _ => continue,
            }
        }
        let delivery = |(message, _): &(jetstream::Message, PaymentRequested)| {
            message
                .info()
                .map(|i| i.delivered.max(1) as u64)
                .unwrap_or(1)
        };
        let handled = policy
            .run_batch(&batch, delivery, |(_, request)| db.apply(&idem, request))
            .await;
        for (item, handled) in batch.iter().zip(handled) {
            let (message, request) = item;
            let verdict = handled.verdict;
            println!(
                "verdict payment_id={} delivery={} cause={:?} action={:?}",
                request.payment_id,
                delivery(item),
                verdict.cause,
                verdict.action
            );
            match verdict.action {
                // Wait for the server to confirm, so a crash right after cannot lose the
                // ack of a recorded outcome (it would only cause a replay, but a quiet one
                // is nicer).
                Action::Ack => message.double_ack().await?,
                Action::Redeliver { after } => message.ack_with(AckKind::Nak(Some(after))).await?,
                Action::Terminate => message.ack_with(AckKind::Term).await?,
            }
        }
        // Idle counts from the end of the last batch, however long it took.
        last_message = Instant::now();
    }
    Ok(())
}
