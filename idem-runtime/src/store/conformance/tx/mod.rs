//! Transactional mode's checks: [`Operation::begin_tx`](crate::Operation::begin_tx) and
//! [`TxGuard::finish`](crate::TxGuard::finish) on one database, written once for
//! SQLite, PostgreSQL and MySQL/MariaDB.
//!
//! Each check takes a [`TxTarget`]: a pool, an [`Idem`] on the same database, a business
//! table whose rows the bodies write, and how to begin and abandon transactions there.
//! Each check works on order ids and operation keys of its own (unique per call), so
//! the checks may share one target and run in any order. Each panics with a message
//! naming the behaviour that broke. A database's tests call [`run_all`], or each
//! check as a test of its own:
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_runtime::Idem;
//! use idem_runtime::store::conformance::tx::{self, TxTarget};
//!
//! let pool = sqlx::SqlitePool::connect("sqlite:///tmp/app.db?mode=rwc").await?;
//! sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
//!     .execute(&pool)
//!     .await?;
//! let idem = Idem::from_pool(pool.clone()).await?;
//! let target = TxTarget::new(pool, idem, "orders")
//!     .begin_with(|pool| async move { pool.begin_with("BEGIN IMMEDIATE").await });
//! tx::run_all(&target).await;
//! # Ok(()) }
//! ```

mod calls;
mod claims;
mod database;
mod duplicates;
mod model;

pub use self::calls::{
    committed_once_then_replayed, expired_outcome_is_claimed_afresh, mismatch_in_transaction,
    recorded_error_after_the_body_sql_failed, released_error_keeps_neither_writes_nor_claim,
    rolled_back_attempt_leaves_nothing, unknown_is_answered_in_a_transaction,
};
pub use self::claims::{
    a_claim_the_body_rolled_back_is_refused, a_record_is_fenced_by_its_claims_epoch,
    a_second_claim_in_the_same_transaction_is_in_flight, current_is_set_in_a_transactional_body,
    nested_operations_in_one_transaction_each_record,
};
pub use self::database::TxDatabase;
pub use self::duplicates::{
    a_duplicate_from_an_older_snapshot_retries_or_replays,
    a_duplicate_waits_for_the_first_transaction, abandoned_claim_is_taken_over_after_its_lease,
    concurrent_duplicates_write_once,
};
pub use self::model::{model_random_schedules, model_seeds};

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::{Pool, Transaction};

use crate::{Idem, IdemError, TxStep};

const DAY: Duration = Duration::from_secs(86_400);

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
type Begin<DB> = Arc<
    dyn Fn(Pool<DB>) -> BoxFuture<'static, Result<Transaction<'static, DB>, sqlx::Error>>
        + Send
        + Sync,
>;
type Abandon<DB> = Arc<dyn Fn(Transaction<'static, DB>) -> BoxFuture<'static, ()> + Send + Sync>;

/// One database under test: what the checks run on, and what differs between
/// databases.
pub struct TxTarget<DB: sqlx::Database> {
    pool: Pool<DB>,
    idem: Idem,
    table: String,
    begin: Begin<DB>,
    begin_snapshot: Begin<DB>,
    /// `None`: as `begin`.
    begin_cancellable: Option<Begin<DB>>,
    abandon: Abandon<DB>,
}

impl<DB: sqlx::Database> Clone for TxTarget<DB> {
    fn clone(&self) -> Self {
        TxTarget {
            pool: self.pool.clone(),
            idem: self.idem.clone(),
            table: self.table.clone(),
            begin: self.begin.clone(),
            begin_snapshot: self.begin_snapshot.clone(),
            begin_cancellable: self.begin_cancellable.clone(),
            abandon: self.abandon.clone(),
        }
    }
}

impl<DB: TxDatabase> TxTarget<DB> {
    /// The checks on `pool`, claiming through `idem` (a store on the same database,
    /// as [`Idem::from_pool`] opens), with bodies writing to `table`: an existing
    /// table, qualified as the pool's connections need, with the columns `id`
    /// (text of up to 64 characters, the primary key) and `qty` (a 64-bit integer).
    ///
    /// Transactions begin with `pool.begin()`, and a cancelled call's transaction is
    /// rolled back, until the methods below say otherwise.
    pub fn new(pool: Pool<DB>, idem: Idem, table: impl Into<String>) -> Self {
        let plain: Begin<DB> =
            Arc::new(|pool: Pool<DB>| Box::pin(async move { pool.begin().await }));
        TxTarget {
            pool,
            idem,
            table: table.into(),
            begin: plain.clone(),
            begin_snapshot: plain,
            begin_cancellable: None,
            abandon: Arc::new(|tx| {
                Box::pin(async move {
                    let _ = tx.rollback().await;
                })
            }),
        }
    }

    /// How a transaction begins, where a duplicate must wait for another's claim to
    /// commit or roll back: on SQLite `BEGIN IMMEDIATE`, which takes the write lock
    /// up front (SQLite has no row locks). Also how a cancellable one begins, unless
    /// [`cancellable_with`](Self::cancellable_with) says.
    pub fn begin_with<F, Fut>(mut self, begin: F) -> Self
    where
        F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
    {
        self.begin = boxed(begin);
        self
    }

    /// How a transaction begins that reads from a snapshot taken at its first read
    /// (REPEATABLE READ, or a deferred SQLite `BEGIN`), for the check that a
    /// duplicate whose snapshot predates the first's commit is never run again.
    /// Default: `pool.begin()`.
    pub fn begin_snapshot_with<F, Fut>(mut self, begin: F) -> Self
    where
        F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
    {
        self.begin_snapshot = boxed(begin);
        self
    }

    /// How a transaction whose call may be cancelled mid-statement begins, and how
    /// it is abandoned after a cancellation. On MySQL the connection is closed
    /// rather than sent a `ROLLBACK`: sqlx's MySQL driver cannot go on with a
    /// connection whose statement is unanswered, and the server discards the open
    /// transaction of a session that closes.
    pub fn cancellable_with<F, Fut, A, AFut>(mut self, begin: F, abandon: A) -> Self
    where
        F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
        A: Fn(Transaction<'static, DB>) -> AFut + Send + Sync + 'static,
        AFut: Future<Output = ()> + Send + 'static,
    {
        self.begin_cancellable = Some(boxed(begin));
        self.abandon = Arc::new(move |tx| Box::pin(abandon(tx)));
        self
    }

    /// The pool the transactions begin on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The `Idem` the operations claim through.
    pub fn idem(&self) -> &Idem {
        &self.idem
    }

    /// The business table the bodies write to.
    pub fn table(&self) -> &str {
        &self.table
    }

    async fn begin(&self) -> Transaction<'static, DB> {
        (self.begin)(self.pool.clone())
            .await
            .expect("begin a transaction")
    }

    async fn begin_snapshot(&self) -> Transaction<'static, DB> {
        (self.begin_snapshot)(self.pool.clone())
            .await
            .expect("begin a snapshot transaction")
    }

    async fn begin_cancellable(&self) -> Transaction<'static, DB> {
        let begin = self.begin_cancellable.as_ref().unwrap_or(&self.begin);
        begin(self.pool.clone())
            .await
            .expect("begin a cancellable transaction")
    }

    /// Inserts the business row `(id, qty)` in `tx`; `id` is one of the checks' own,
    /// so it needs no quoting.
    async fn insert(
        &self,
        tx: &mut Transaction<'static, DB>,
        id: &str,
        qty: i64,
    ) -> Result<(), sqlx::Error> {
        let sql = format!(
            "INSERT INTO {} (id, qty) VALUES ('{id}', {qty})",
            self.table
        );
        DB::execute(&mut **tx, sql).await
    }

    /// The committed business rows whose id is `id` or starts with `id#`.
    async fn rows(&self, id: &str) -> Vec<(String, i64)> {
        let sql = format!(
            "SELECT id, qty FROM {} WHERE id = '{id}' OR id LIKE '{id}#%'",
            self.table
        );
        DB::rows(&self.pool, sql)
            .await
            .expect("read the business table")
    }
}

fn boxed<DB, F, Fut>(begin: F) -> Begin<DB>
where
    DB: sqlx::Database,
    F: Fn(Pool<DB>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Transaction<'static, DB>, sqlx::Error>> + Send + 'static,
{
    Arc::new(move |pool| Box::pin(begin(pool)))
}

/// What the checks' bodies fail with: released by default, recorded where a check
/// records errors. idem's own errors are answered, never recorded.
#[derive(Debug, Serialize, Deserialize)]
enum Failure {
    Declined(String),
    Timeout,
    #[serde(skip)]
    Idem(IdemError),
}

impl From<IdemError> for Failure {
    fn from(e: IdemError) -> Self {
        Failure::Idem(e)
    }
}

/// An id no other check (and no earlier run on a durable database) uses: short, as
/// the business table's id holds 64 characters, and free of `_` and `%`, which
/// `LIKE` would read as wildcards.
fn fresh(check: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{check}-{:x}-{nanos:x}-{n}", std::process::id())
}

/// Places `order` in `tx`: one business row, claimed and recorded in the same
/// transaction, answering `qty * 100`. `fail` makes the body write, then return a
/// released error.
async fn place<DB>(
    t: &TxTarget<DB>,
    tx: &mut Transaction<'static, DB>,
    order: &str,
    qty: i64,
    fail: bool,
) -> Result<i64, Failure>
where
    DB: TxDatabase,
{
    let op = t
        .idem
        .operation("place_order", order)
        .fingerprint(&qty)
        .retain(DAY);
    let guard = match op.begin_tx(DB::tx(tx)).await? {
        TxStep::Replay(out) => return out,
        TxStep::Run(g) => g,
    };
    let out = async {
        t.insert(tx, order, qty)
            .await
            .map_err(|e| Failure::Declined(e.to_string()))?;
        if fail {
            Err(Failure::Timeout)
        } else {
            Ok(qty * 100)
        }
    }
    .await;
    guard.finish(DB::tx(tx), out).await
}

/// Places `order` in a transaction of its own, committed if the body answered `Ok`
/// and rolled back otherwise: the answer.
async fn place_committed<DB>(t: &TxTarget<DB>, order: &str, qty: i64) -> Result<i64, Failure>
where
    DB: TxDatabase,
{
    let mut tx = t.begin().await;
    let out = place(t, &mut tx, order, qty, false).await;
    if out.is_ok() {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    out
}

/// Claims `order` (payload `qty`) in `tx` for a body the check runs by hand.
async fn claim<DB>(
    t: &TxTarget<DB>,
    tx: &mut Transaction<'static, DB>,
    order: &str,
    qty: i64,
) -> Result<TxStep<i64, Failure, crate::TxGuard<crate::ReleaseErrors, crate::NoUpgrade>>, IdemError>
where
    DB: TxDatabase,
{
    let op = t
        .idem
        .operation("place_order", order)
        .fingerprint(&qty)
        .retain(DAY);
    op.begin_tx(DB::tx(tx)).await
}

/// Every check of the suite, in turn.
pub async fn run_all<DB>(t: &TxTarget<DB>)
where
    DB: TxDatabase,
{
    committed_once_then_replayed(t).await;
    released_error_keeps_neither_writes_nor_claim(t).await;
    rolled_back_attempt_leaves_nothing(t).await;
    mismatch_in_transaction(t).await;
    a_claim_the_body_rolled_back_is_refused(t).await;
    a_record_is_fenced_by_its_claims_epoch(t).await;
    a_second_claim_in_the_same_transaction_is_in_flight(t).await;
    nested_operations_in_one_transaction_each_record(t).await;
    current_is_set_in_a_transactional_body(t).await;
    a_duplicate_waits_for_the_first_transaction(t).await;
    a_duplicate_from_an_older_snapshot_retries_or_replays(t).await;
    concurrent_duplicates_write_once(t).await;
    abandoned_claim_is_taken_over_after_its_lease(t).await;
    recorded_error_after_the_body_sql_failed(t).await;
    expired_outcome_is_claimed_afresh(t).await;
    unknown_is_answered_in_a_transaction(t).await;
    model_random_schedules(t).await;
}
