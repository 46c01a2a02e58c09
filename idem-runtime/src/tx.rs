//! Transactional mode: the claim and the record run inside the caller's own sqlx
//! transaction, beside the body's writes, and commit or roll back with them.
//!
//! The row lock is the claim and rollback is the release, so while the transaction is
//! open there is no renewal, takeover or fencing. The body runs inside a savepoint
//! taken before the claim, `idem_body_<n>`: a released `Err` rolls back to it, leaving
//! neither the body's writes nor the claim in the transaction. Each operation's
//! savepoints (`idem_body_<n>`, `idem_run_<n>`) carry a number no other operation in the
//! process uses, so operations nested in one transaction, or a second claim of the same
//! key in it, never touch another operation's savepoints. How it behaves on each
//! database: [`guide::transactions`](crate::guide::transactions).

use crate::error::IdemError;
use crate::op::{ErrorPolicy, Operation, RecordableOutcome, Upgrade};

#[cfg(feature = "_sql")]
use crate::error::StoreError;
#[cfg(feature = "_sql")]
use crate::op::Encoded;
#[cfg(feature = "_sql")]
use crate::store::engine::{Dialect, SqlDb, SqlStore, TxClaim};
#[cfg(feature = "_sql")]
use crate::store::{Fence, OperationId, StoredOutcome};

/// One operation's savepoints in the caller's transaction, named `idem_body_<n>` and
/// `idem_run_<n>` with an `n` no other operation in the process has. Names of their own
/// because MySQL does not nest savepoints of one name (a second `SAVEPOINT x` replaces
/// the first), and so that each guard rolls back to and releases exactly its own.
#[cfg(feature = "_sql")]
struct Savepoints {
    /// Taken before the claim: rolling back to it undoes the body's writes and the claim.
    body: String,
    /// Taken after the claim, before the body: rolling back to it undoes the body's writes
    /// and keeps the claim, so an error can still be recorded after the body's own SQL
    /// failed (which aborts a PostgreSQL transaction).
    run: String,
}

#[cfg(feature = "_sql")]
impl Savepoints {
    /// The next operation's names.
    fn next() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Savepoints {
            body: format!("idem_body_{n}"),
            run: format!("idem_run_{n}"),
        }
    }
}

/// What [`Operation::begin_tx`] decided. See [`TxGuard`] for both halves in use.
pub enum TxStep<T, E, G> {
    /// The operation completed in an earlier transaction: its outcome.
    Replay(Result<T, E>),
    /// This transaction holds the claim: run the body, then [`TxGuard::finish`].
    Run(G),
}

/// A transaction idem can claim in: `sqlx::Transaction` on PostgreSQL, MySQL/MariaDB or
/// SQLite.
///
/// ```
/// use idem_runtime::{BoxError, Idem, TxConnection, TxStep};
/// use std::time::Duration;
///
/// /// Ships `order` once, inside whatever transaction the caller holds.
/// async fn ship<C: TxConnection>(idem: &Idem, tx: &mut C, order: &str) -> Result<bool, BoxError> {
///     let op = idem
///         .operation("ship", order)
///         .retain(Duration::from_secs(86_400))
///         .fingerprint_none();
///     let step: TxStep<bool, BoxError, _> = op.begin_tx(&mut *tx).await?;
///     Ok(match step {
///         TxStep::Replay(shipped) => shipped?,
///         TxStep::Run(guard) => guard.finish(&mut *tx, Ok::<_, BoxError>(true)).await?,
///     })
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a transaction idem can claim in",
    label = "the `tx` parameter must be `&mut sqlx::Transaction<'_, Postgres>`, `&mut sqlx::Transaction<'_, MySql>` or `&mut sqlx::Transaction<'_, Sqlite>`",
    note = "enable the `postgres`, `mysql` or `sqlite` feature of idem-runtime for the matching transaction type"
)]
pub trait TxConnection: sealed::Sealed + Send {
    /// The transaction's database. Not a stable API.
    #[doc(hidden)]
    #[cfg(feature = "_sql")]
    type Db: SqlDb;

    /// The connection under the transaction. Not a stable API.
    #[doc(hidden)]
    #[cfg(feature = "_sql")]
    fn idem_conn(&mut self) -> &mut <Self::Db as sqlx::Database>::Connection;
}

mod sealed {
    pub trait Sealed {}
}

#[cfg(feature = "_sql")]
impl<DB: SqlDb> sealed::Sealed for sqlx::Transaction<'_, DB> {}

/// A transaction on each database whose feature is enabled: `Postgres` (`postgres`),
/// `MySql` (`mysql`), `Sqlite` (`sqlite`).
#[cfg(feature = "_sql")]
impl<DB: SqlDb> TxConnection for sqlx::Transaction<'_, DB> {
    type Db = DB;

    fn idem_conn(&mut self) -> &mut DB::Connection {
        self
    }
}

/// The dialect of `C`'s database.
#[cfg(feature = "_sql")]
type DialectOf<C> = <<C as TxConnection>::Db as SqlDb>::Dialect;

/// Transactional mode on one connection: idem's store on its database, and the
/// connection.
#[cfg(feature = "_sql")]
struct InTx<'a, D: Dialect> {
    store: &'a SqlStore<D>,
    conn: &'a mut D::Conn,
}

#[cfg(feature = "_sql")]
impl<'a, D: Dialect> InTx<'a, D> {
    /// Fails unless `idem`'s store is on this connection's kind of database.
    fn new(idem: &'a crate::Idem, conn: &'a mut D::Conn) -> Result<Self, IdemError> {
        let store = idem
            .sql_store()
            .and_then(|handle| handle.store::<D>())
            .ok_or_else(wrong_store)?;
        Ok(InTx { store, conn })
    }

    /// Runs a savepoint statement as a script: unprepared (PostgreSQL's simple protocol,
    /// MySQL's text protocol, which is all MySQL takes savepoints over), since each
    /// operation's savepoint names are new and preparing them would cost a round trip
    /// each and crowd the caller's statement cache.
    async fn exec(&mut self, sql: &str) -> Result<(), StoreError> {
        let dialect = &self.store.dialect;
        dialect.run_script(self.conn, sql).await.map_err(D::map_err)
    }

    /// Takes the savepoint `name`.
    async fn savepoint(&mut self, name: &str) -> Result<(), StoreError> {
        self.exec(&format!("SAVEPOINT {name}")).await
    }

    /// Releases the savepoint `name`.
    async fn release(&mut self, name: &str) -> Result<(), StoreError> {
        self.exec(&format!("RELEASE SAVEPOINT {name}")).await
    }

    /// Rolls back to the savepoint `name`, which stays.
    async fn rollback_to(&mut self, name: &str) -> Result<(), StoreError> {
        self.exec(&format!("ROLLBACK TO SAVEPOINT {name}")).await
    }

    async fn claim(
        &mut self,
        id: &OperationId,
        fp: &[u8; 32],
        lease: std::time::Duration,
    ) -> Result<TxClaim, IdemError> {
        let claimed = self.store.tx_claim(self.conn, id, fp, lease).await;
        claimed.map_err(store_err("claim"))
    }

    async fn record(
        &mut self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: std::time::Duration,
    ) -> Result<Fence, IdemError> {
        let recorded = self.store.tx_record(self.conn, id, epoch, outcome, retain);
        recorded.await.map_err(store_err("record"))
    }

    /// Rolls the body's writes and the claim back to the savepoint `body`, and drops it.
    async fn undo_body(&mut self, body: &str) -> Result<(), IdemError> {
        self.rollback_to(body)
            .await
            .map_err(store_err("rollback"))?;
        self.release(body).await.map_err(store_err("rollback"))
    }

    /// Whether the server rolled the whole transaction back, idem's savepoints and claim
    /// with it (MySQL does on a deadlock; see [`Dialect::transaction_gone`]).
    async fn rolled_back(&mut self) -> bool {
        self.store.dialect.transaction_gone(self.conn).await
    }

    /// `err`, found where idem's claim or savepoint should be, unless the server rolled
    /// the transaction back: then a retryable error saying to retry the whole
    /// transaction, which no savepoint or record can save.
    async fn lost(&mut self, name: &str, err: IdemError) -> IdemError {
        if self.rolled_back().await {
            rolled_back(name)
        } else {
            err
        }
    }
}

/// The server rolled back the transaction running `name`: retryable, as a deadlock is.
#[cfg(feature = "_sql")]
fn rolled_back(name: &str) -> IdemError {
    IdemError::store(
        "record",
        StoreError::new(
            true,
            format!(
                "the database rolled back the whole transaction running `{name}` (a deadlock, \
                 or a lock-wait timeout under innodb_rollback_on_timeout), with idem's claim \
                 and the body's writes; nothing was recorded: retry the whole transaction"
            ),
        ),
    )
}

#[cfg(feature = "_sql")]
fn wrong_store() -> IdemError {
    IdemError::Config {
        message: "transactional mode (`tx = ...`) needs an idem store on the same kind of \
                  database as the transaction: open the `Idem` with `Idem::postgres`, \
                  `Idem::mysql`, `Idem::sqlite` or `Idem::from_pool` on that database"
            .into(),
    }
}

/// The claim this transaction holds; [`finish`](TxGuard::finish) records the outcome.
///
/// What `#[idempotent(tx = tx, ...)]` expands to, written out:
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::BoxError> {
/// use idem_runtime::{BoxError, Idem, TxStep};
/// use std::time::Duration;
///
/// let pool = sqlx::sqlite::SqlitePoolOptions::new()
///     .max_connections(1)
///     .connect("sqlite::memory:")
///     .await?;
/// sqlx::query("CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)")
///     .execute(&pool)
///     .await?;
/// sqlx::query("INSERT INTO stock VALUES ('apple', 10)").execute(&pool).await?;
/// let idem = Idem::from_pool(pool.clone()).await?;
///
/// for _ in 0..2 {
///     let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
///     let op = idem
///         .operation("reserve", "order-7")
///         .retain(Duration::from_secs(86_400))
///         .fingerprint(&3);
///     let step: TxStep<i64, BoxError, _> = op.begin_tx(&mut tx).await?;
///     let left = match step {
///         TxStep::Replay(outcome) => outcome?, // committed by an earlier transaction
///         TxStep::Run(guard) => {
///             let out: Result<i64, BoxError> = guard
///                 .body(async {
///                     sqlx::query("UPDATE stock SET qty = qty - 3 WHERE sku = 'apple'")
///                         .execute(&mut *tx)
///                         .await?;
///                     Ok(sqlx::query_scalar("SELECT qty FROM stock WHERE sku = 'apple'")
///                         .fetch_one(&mut *tx)
///                         .await?)
///                 })
///                 .await;
///             guard.finish(&mut tx, out).await?
///         }
///     };
///     tx.commit().await?;
///     assert_eq!(left, 7); // reserved once
/// }
/// # Ok(()) }
/// # #[cfg(not(feature = "sqlite"))]
/// # fn main() {}
/// ```
#[must_use = "call `finish` with the body's result, or the claim is recorded as nothing"]
pub struct TxGuard<P, U> {
    op: Operation<P, U>,
    epoch: u64,
    #[cfg(feature = "_sql")]
    savepoints: Savepoints,
}

impl<P, U> TxGuard<P, U> {
    /// Runs the body with [`current`](crate::current) set to this operation, as a leased
    /// body has it.
    pub async fn body<F: std::future::Future>(&self, body: F) -> F::Output {
        let steps = crate::step_state::StepsMode::Transactional;
        crate::context::scope_body(self.op.id.shared(), self.epoch, steps, body)
            .await
            .0
    }

    /// The savepoint this operation took before its claim, `idem_body_<n>`: rolling back
    /// to it undoes the claim. For checks that undo the claim as a misbehaving body
    /// would; not a stable API.
    #[doc(hidden)]
    #[cfg(feature = "_sql")]
    pub fn savepoint(&self) -> &str {
        &self.savepoints.body
    }
}

#[cfg(feature = "_sql")]
fn store_err(during: &'static str) -> impl Fn(StoreError) -> IdemError {
    move |e| IdemError::store(during, e)
}

impl<P, U, FP, R> Operation<P, U, FP, R> {
    /// Transactional mode, first half: claims the operation inside `tx`.
    ///
    /// On PostgreSQL a concurrent duplicate blocks on the row until this transaction
    /// ends (bounded by the caller's `lock_timeout`), then replays the committed
    /// outcome, or claims afresh if this one rolled back. Under REPEATABLE READ or
    /// SERIALIZABLE the conflict is a serialization failure: [`IdemError::Store`] with
    /// `is_retryable() == true`; retry the whole transaction. On SQLite begin the
    /// transaction with `BEGIN IMMEDIATE` so a duplicate waits on the database lock
    /// (up to `busy_timeout`) instead of failing on upgrade.
    ///
    /// # Cancelling a call on MySQL
    ///
    /// sqlx's MySQL driver cannot go on with a connection whose statement was dropped
    /// before its answer: a later `ROLLBACK` on it can wait forever or read the dropped
    /// statement's reply. If this call (or [`TxGuard::finish`], or the body) may be
    /// cancelled, by a timeout or a client going away, begin the transaction on a
    /// connection that closes when dropped, and drop it instead of rolling back after a
    /// cancellation; the server rolls the transaction back, idem's claim with it:
    ///
    /// ```no_run
    /// # #[cfg(feature = "mysql")]
    /// # async fn f(pool: sqlx::MySqlPool) -> Result<(), sqlx::Error> {
    /// let mut conn = pool.acquire().await?;
    /// conn.close_on_drop();
    /// let tx = sqlx::Transaction::begin(conn, None).await?;
    /// # drop(tx); Ok(()) }
    /// ```
    pub async fn begin_tx<C, T, E>(
        self,
        tx: &mut C,
    ) -> Result<TxStep<T, E, TxGuard<P, U>>, IdemError>
    where
        C: TxConnection,
        T: RecordableOutcome,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
        U: Upgrade<T>,
        FP: crate::op::FingerprintStated,
        R: crate::op::RetentionStated,
    {
        #[cfg(not(feature = "_sql"))]
        {
            let _ = (self, tx);
            unreachable!("without a SQL store no type implements `TxConnection`")
        }
        #[cfg(feature = "_sql")]
        {
            let mut this = self.stated();
            this.take_invalid()?;
            let idem = this.idem_handle()?;
            let mut conn = InTx::<DialectOf<C>>::new(&idem, tx.idem_conn())?;
            let fp = this.fingerprint_bytes();
            let savepoints = Savepoints::next();
            conn.savepoint(&savepoints.body)
                .await
                .map_err(store_err("savepoint"))?;
            let claim = conn.claim(this.id(), &fp, this.lease_for()).await?;
            // Only a claim acquired in this transaction is new (a claim here that rolled
            // back left nothing to take over), so only it is counted; one over the limit
            // is undone with the savepoint, and nothing of it is ever committed.
            if let TxClaim::Acquired { .. } = claim
                && let Some(limiter) = this.claim_limit.as_ref().or(idem.claim_limit())
            {
                let taken = crate::bounded::bounded(
                    idem.store_timeout(),
                    "claim limit",
                    limiter.take(this.id(), &**idem.store()),
                );
                let refused = match taken.await {
                    Ok(None) => None,
                    Ok(Some(retry_after)) => {
                        let name = this.id().name.clone();
                        crate::metrics::count(crate::metrics::RATE_LIMITED, &name);
                        Some(IdemError::RateLimited { name, retry_after })
                    }
                    Err(e) => Some(IdemError::store("claim", e)),
                };
                if let Some(refused) = refused {
                    conn.rollback_to(&savepoints.body)
                        .await
                        .map_err(store_err("rollback"))?;
                    conn.release(&savepoints.body)
                        .await
                        .map_err(store_err("savepoint"))?;
                    return Err(refused);
                }
            }
            if let TxClaim::Acquired { epoch } = claim {
                crate::metrics::count(crate::metrics::CLAIMS, &this.id().name);
                conn.savepoint(&savepoints.run)
                    .await
                    .map_err(store_err("savepoint"))?;
                tracing::debug!(scope = ?idem.log_key(&this.id().scope), name = ?this.id().name, key = ?idem.log_key(&this.id().key), epoch, "claimed in transaction");
                return Ok(TxStep::Run(TxGuard {
                    op: this,
                    epoch,
                    savepoints,
                }));
            }
            conn.release(&savepoints.body)
                .await
                .map_err(store_err("savepoint"))?;
            let name = this.id().name.clone();
            match claim {
                TxClaim::Completed(outcome) => {
                    crate::metrics::count(crate::metrics::REPLAYS, &name);
                    crate::context::report_replay();
                    Ok(TxStep::Replay(this.decode_outcome(outcome.view())))
                }
                TxClaim::Mismatch => {
                    crate::metrics::count(crate::metrics::MISMATCHES, &name);
                    Err(IdemError::Mismatch { name })
                }
                TxClaim::Unknown { epoch } => Err(IdemError::Unknown { name, epoch }),
                TxClaim::InFlight { retry_after } => {
                    crate::metrics::count(crate::metrics::IN_FLIGHT, &name);
                    Err(IdemError::InFlight { name, retry_after })
                }
                TxClaim::Acquired { .. } => unreachable!("handled above"),
            }
        }
    }
}

impl<P, U> TxGuard<P, U> {
    /// Transactional mode, second half: records the body's outcome in `tx`, or rolls
    /// the body and the claim back to the savepoint for a released `Err`.
    ///
    /// An `Err` classified `Unknown` is recorded like `Record` here: the body's writes
    /// commit or roll back with the transaction, so nothing inside it is in doubt, and
    /// recording keeps a duplicate from running an external effect twice.
    ///
    /// On MySQL a deadlock, or a lock-wait timeout under `innodb_rollback_on_timeout`,
    /// rolls the whole transaction back, claim included: this then answers a retryable
    /// [`IdemError::Store`]; retry the whole transaction. A claim that vanished otherwise
    /// (the body rolled back to or released this operation's savepoint `idem_body_<n>`)
    /// is an [`IdemError::Config`] on every database: nothing was recorded, so roll the
    /// transaction back.
    pub async fn finish<C, T, E>(self, tx: &mut C, out: Result<T, E>) -> Result<T, E>
    where
        C: TxConnection,
        T: RecordableOutcome,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
    {
        #[cfg(not(feature = "_sql"))]
        {
            let _ = (self, tx, out);
            unreachable!("without a SQL store no type implements `TxConnection`")
        }
        #[cfg(feature = "_sql")]
        {
            let (op, epoch, savepoints) = (self.op, self.epoch, self.savepoints);
            let idem = op.idem_handle()?;
            let mut conn = InTx::<DialectOf<C>>::new(&idem, tx.idem_conn())?;
            let name = op.id().name.clone();
            let max = idem.max_outcome_bytes();
            let (stored, result) = match op.encode(out, max, true) {
                Encoded::Record(stored, result) => (stored, result),
                Encoded::Release(err) | Encoded::Unknown(err) => {
                    if let Err(e) = conn.undo_body(&savepoints.body).await {
                        return Err(conn.lost(&name, e).await.into());
                    }
                    return Err(err);
                }
                // Unlike the leased path, nothing escaped: roll the body back with the claim.
                Encoded::Unrecordable(why) => {
                    if let Err(e) = conn.undo_body(&savepoints.body).await {
                        return Err(conn.lost(&name, e).await.into());
                    }
                    let then = "the body's writes were rolled back";
                    return Err(why.rolled_back(&name, max, then).into());
                }
            };
            let recorded = match conn.record(op.id(), epoch, &stored, op.retain_for()).await {
                Ok(fence) => fence,
                Err(e) => match result {
                    // The body's own SQL may have failed and aborted the transaction
                    // (PostgreSQL): undo the body's writes, keep the claim, record again.
                    // Never hide the body's error behind idem's.
                    Err(err) => {
                        tracing::debug!(error = %e, "record failed; recording again without the body's writes");
                        let again = match conn.rollback_to(&savepoints.run).await {
                            Ok(()) => conn
                                .record(op.id(), epoch, &stored, op.retain_for())
                                .await
                                .ok(),
                            Err(_) => None,
                        };
                        if again != Some(Fence::Held) {
                            // Nothing recorded: release the claim with the body's writes.
                            let undone = conn.undo_body(&savepoints.body).await;
                            if undone.is_err() && conn.rolled_back().await {
                                return Err(rolled_back(&name).into());
                            }
                            return Err(err);
                        }
                        if let Err(e) = conn.release(&savepoints.body).await {
                            let e = IdemError::store("savepoint", e);
                            return Err(conn.lost(&name, e).await.into());
                        }
                        crate::context::report_run(epoch, true);
                        return Err(err);
                    }
                    Ok(_) => return Err(conn.lost(&name, e).await.into()),
                },
            };
            match recorded {
                Fence::Held => {}
                Fence::Lost => {
                    let vanished = IdemError::Config {
                        message: format!(
                            "the transactional claim on `{name}` vanished before its record, so \
                             nothing was recorded: roll the transaction back rather than commit \
                             the body's writes unprotected; was the savepoint `{}` \
                             released or rolled back by the body?",
                            savepoints.body
                        ),
                    };
                    return Err(conn.lost(&name, vanished).await.into());
                }
            }
            if let Err(e) = conn.release(&savepoints.body).await {
                let e = IdemError::store("savepoint", e);
                return Err(conn.lost(&name, e).await.into());
            }
            crate::context::report_run(epoch, true);
            result
        }
    }
}

#[cfg(all(test, feature = "_sql"))]
mod tests {
    use super::*;

    /// Transactional mode's futures are `Send` for any transaction type, so code generic
    /// over it can spawn them. Checked at compile time; never run.
    #[allow(dead_code)]
    fn futures_are_send<C: TxConnection>(idem: &crate::Idem, tx: &mut C) {
        fn send<T: Send>(_: T) {}
        send(async move {
            let op = idem
                .operation("op", "key")
                .retain(std::time::Duration::from_secs(1))
                .fingerprint_none();
            if let Ok(TxStep::Run(guard)) = op.begin_tx::<C, (), IdemError>(&mut *tx).await {
                let _ = guard.finish(&mut *tx, Ok::<(), IdemError>(())).await;
            }
        });
    }
}
