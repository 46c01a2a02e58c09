//! Transactional mode's claim and record on the caller's connection: the claim as
//! statements inside the caller's transaction ([`TxSteps`], [`tx_claim`]), what it
//! decided ([`TxClaim`]), and [`SqlStore`]'s `tx_claim` and `tx_record`, which
//! `crate::tx` calls.

use std::time::Duration;

use super::values::{
    Arg, Row, corrupt, duration_ms, epoch_from_sql, lease_millis, outcome_from_sql, sql_epoch,
};
use super::{Dialect, On, SqlStore, Stmt, fence, id_args, outcome_args};
use crate::error::StoreError;
use crate::store::{Fence, OperationId, StoredOutcome};

/// What a claim inside the caller's transaction decided (transactional mode: no lease,
/// no epochs to fence on; the row lock is the claim and rollback is the release).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TxClaim {
    /// This transaction holds the claim at `epoch`: run the body, then `tx_record_*`.
    Acquired {
        /// The claim's epoch (what `current().epoch()` shows in the body).
        epoch: u64,
    },
    /// The operation completed (committed by another transaction): replay this.
    Completed(StoredOutcome),
    /// The key is bound to another fingerprint.
    Mismatch,
    /// The operation is UNKNOWN (moved there outside transactional mode).
    Unknown {
        /// The epoch whose effect is unknown.
        epoch: u64,
    },
    /// The record is IN_PROGRESS and visible: this same transaction claimed it already,
    /// or a claim made outside transactional mode holds it.
    InFlight {
        /// The remaining lease by the store's clock (zero for a transactional claim).
        retry_after: Duration,
    },
}

/// The row transactional mode's read returns, in backend-neutral form.
#[derive(Debug)]
pub(crate) struct TxRow {
    /// The stored fingerprint equals the request's.
    pub(crate) same_fingerprint: bool,
    /// COMPLETED and past its retention: it counts as absent.
    pub(crate) expired: bool,
    /// IN_PROGRESS and its lease lapsed: its owner is gone (a cancelled transactional
    /// body whose transaction committed anyway, or a crashed leased caller).
    pub(crate) lapsed: bool,
    /// The state code.
    pub(crate) state: i64,
    /// The epoch.
    pub(crate) epoch: i64,
    /// Remaining lease by the store's clock.
    pub(crate) retry_after_ms: i64,
    /// The outcome columns, read when the row is COMPLETED.
    pub(crate) outcome: Option<Vec<u8>>,
    /// Whether the outcome is an `Err`.
    pub(crate) outcome_is_err: bool,
    /// The outcome's version.
    pub(crate) outcome_version: i64,
}

/// The statements of a transactional claim, each over (scope, name, key, fingerprint),
/// as one backend runs them on the caller's connection.
pub(crate) trait TxSteps {
    /// The insert of a fresh claim: its epoch, if it inserted.
    async fn insert(&mut self) -> Result<Option<i64>, StoreError>;
    /// The existing row, if any.
    async fn read(&mut self) -> Result<Option<TxRow>, StoreError>;
    /// A fresh claim over an expired COMPLETED row: its epoch, if it took it.
    async fn reclaim_expired(&mut self) -> Result<Option<i64>, StoreError>;
    /// A takeover of a lapsed IN_PROGRESS row of the same fingerprint: its epoch, if it
    /// took it.
    async fn take_over(&mut self) -> Result<Option<i64>, StoreError>;
}

/// How often a transactional claim retries when the row it conflicted with vanished
/// (or expired) before it could be read.
const TX_ATTEMPTS: usize = 5;

/// Transactional mode's claim, the same for both backends: insert, else read the row the
/// insert conflicted with (committed by now: the insert waited on its lock), and decide.
pub(crate) async fn tx_claim(steps: &mut impl TxSteps) -> Result<TxClaim, StoreError> {
    let acquired = |epoch| {
        Ok::<_, StoreError>(TxClaim::Acquired {
            epoch: epoch_from_sql(epoch)?,
        })
    };
    for _ in 0..TX_ATTEMPTS {
        if let Some(epoch) = steps.insert().await? {
            return acquired(epoch);
        }
        let Some(row) = steps.read().await? else {
            continue; // deleted since the insert saw it: try the insert again
        };
        if row.expired {
            match steps.reclaim_expired().await? {
                Some(epoch) => return acquired(epoch),
                None => continue,
            }
        }
        // The two modes agree: a claim whose owner is gone is taken over after its
        // lease, whichever mode made it, so no key stays blocked.
        if row.lapsed && row.same_fingerprint {
            match steps.take_over().await? {
                Some(epoch) => return acquired(epoch),
                None => continue,
            }
        }
        return decide_tx(row);
    }
    Err(StoreError::new(
        true,
        "the idem record kept changing under the transactional claim; retry the transaction",
    ))
}

fn decide_tx(row: TxRow) -> Result<TxClaim, StoreError> {
    use crate::store::State;
    if !row.same_fingerprint {
        return Ok(TxClaim::Mismatch);
    }
    match State::from_code(row.state) {
        Some(State::Completed) => Ok(TxClaim::Completed(outcome_from_sql(
            row.outcome,
            row.outcome_is_err,
            row.outcome_version,
        )?)),
        Some(State::InProgress) => Ok(TxClaim::InFlight {
            retry_after: duration_ms(row.retry_after_ms),
        }),
        Some(State::Unknown) => Ok(TxClaim::Unknown {
            epoch: epoch_from_sql(row.epoch)?,
        }),
        None => Err(corrupt(format!("unknown state code {}", row.state))),
    }
}

/// Transactional mode's statements on the caller's connection.
struct TxConn<'a, D: Dialect> {
    store: &'a SqlStore<D>,
    conn: &'a mut D::Conn,
    id: &'a OperationId,
    fingerprint: &'a [u8; 32],
    lease: i64,
}

impl<D: Dialect> TxConn<'_, D> {
    async fn step(&mut self, stmt: &Stmt) -> Result<Vec<Row>, StoreError> {
        let mut named = id_args(self.id).to_vec();
        named.push(("fp", Arg::Bytes(self.fingerprint)));
        named.push(("lease_ms", Arg::Int(self.lease)));
        let args = stmt.args(&named)?;
        self.store
            .dialect
            .fetch(On::Conn(&mut *self.conn), stmt, args)
            .await
            .map_err(D::map_err)
    }

    /// A claiming statement: the epoch it returned, if it claimed.
    async fn claiming(&mut self, stmt: &Stmt) -> Result<Option<i64>, StoreError> {
        match self.step(stmt).await?.first() {
            Some(row) => row.int("epoch").map(Some),
            None => Ok(None),
        }
    }
}

impl<D: Dialect> TxSteps for TxConn<'_, D> {
    async fn insert(&mut self) -> Result<Option<i64>, StoreError> {
        let sql = &self.store.sql;
        self.claiming(&sql.tx_claim).await
    }

    async fn read(&mut self) -> Result<Option<TxRow>, StoreError> {
        let sql = &self.store.sql;
        let rows = self.step(&sql.tx_read).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        Ok(Some(TxRow {
            same_fingerprint: row.flag("same_fingerprint")?,
            expired: row.flag("expired")?,
            lapsed: row.flag("lapsed")?,
            state: row.int("state")?,
            epoch: row.int("epoch")?,
            retry_after_ms: row.int("retry_after_ms")?,
            outcome: row.opt_bytes("outcome")?,
            outcome_is_err: row.flag("outcome_is_err")?,
            outcome_version: row.int("outcome_version")?,
        }))
    }

    async fn reclaim_expired(&mut self) -> Result<Option<i64>, StoreError> {
        let sql = &self.store.sql;
        self.claiming(&sql.tx_reclaim).await
    }

    async fn take_over(&mut self) -> Result<Option<i64>, StoreError> {
        let sql = &self.store.sql;
        self.claiming(&sql.tx_takeover).await
    }
}

impl<D: Dialect> SqlStore<D> {
    /// Transactional mode: claims `id` inside the caller's transaction on `conn`.
    pub(crate) async fn tx_claim(
        &self,
        conn: &mut D::Conn,
        id: &OperationId,
        fingerprint: &[u8; 32],
        lease: Duration,
    ) -> Result<TxClaim, StoreError> {
        tx_claim(&mut TxConn {
            store: self,
            conn,
            id,
            fingerprint,
            lease: lease_millis(lease),
        })
        .await
    }

    /// Transactional mode: records the outcome of the claim this transaction holds at
    /// `epoch`. Fenced like a leased record: should the server have rolled the
    /// transaction back (a MySQL deadlock victim), the statement runs on its own and
    /// must not complete another caller's claim made meanwhile.
    pub(crate) async fn tx_record(
        &self,
        conn: &mut D::Conn,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        let Some(epoch) = sql_epoch(epoch) else {
            return Ok(Fence::Lost);
        };
        let mut named = id_args(id).to_vec();
        named.push(("epoch", Arg::Int(epoch)));
        named.extend_from_slice(&outcome_args(outcome, retain));
        let args = self.sql.tx_record.args(&named)?;
        let rows = self
            .dialect
            .fetch(On::Conn(conn), &self.sql.tx_record, args)
            .await
            .map_err(D::map_err)?;
        // Held only when the update changed a row: PostgreSQL and SQLite return one row
        // per changed record, MySQL one row with the count of rows the update matched.
        fence(&rows)
    }
}
