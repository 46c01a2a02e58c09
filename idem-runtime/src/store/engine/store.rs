//! [`SqlStore`]'s [`Store`] and [`Admin`] impls: each call of the state machine and of
//! the operator as the statements it issues and the rows it reads back.

use std::time::Duration;

use super::values::{
    Arg, Row, corrupt, duration_ms, epoch_from_sql, lease_millis, millis, outcome_from_sql,
    record_detail, sql_epoch,
};
use super::{Dialect, Gathered, On, SqlStore, claim_args, fence, id_args, wake_payload};
use crate::error::StoreError;
use crate::store::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail,
    RecordInfo, State, Stats, StepRecord, Store, StoreFuture, StoredOutcome, Takeover,
};

/// The code `stats.sql` gives IN_PROGRESS records released with their steps kept
/// (`steps = 2`), beside the state codes: no claim holds them, so they are no stuck
/// claims.
const RELEASED: i64 = 3;

/// Records purged per statement, so a large purge does not lock many rows at once.
const PURGE_BATCH: i64 = 1000;

fn record_info(row: &Row) -> Result<RecordInfo, StoreError> {
    let code = row.int("state")?;
    Ok(RecordInfo {
        id: OperationId {
            scope: row.text("scope")?,
            name: row.text("name")?,
            key: row.text("key")?,
        },
        state: State::from_code(code)
            .ok_or_else(|| corrupt(format!("unknown state code {code}")))?,
        epoch: epoch_from_sql(row.int("epoch")?)?,
        age: duration_ms(row.int("age_ms")?),
    })
}

impl<D: Dialect> Store for SqlStore<D> {
    fn claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
    ) -> StoreFuture<'a, Result<Claim, StoreError>> {
        StoreFuture::new(async move {
            let to_unknown = req.on_takeover == Takeover::Unknown;
            let named = claim_args(
                req.id,
                &req.fingerprint,
                lease_millis(req.lease),
                to_unknown,
            );
            let claim = match self.claim_fresh(req, &named).await? {
                Some(epoch) => Claim::Acquired {
                    epoch,
                    takeover: false,
                    resume: false,
                },
                None => self.claim_full(req, named).await?,
            };
            if D::PEEK_WHILE_REPLAYING {
                self.gate
                    .saw(matches!(claim, Claim::Completed(_) | Claim::Mismatch));
            }
            Ok(claim)
        })
    }

    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        StoreFuture::new(async move {
            let Some(peek) = &self.sql.peek else {
                return Ok(None);
            };
            if D::PEEK_WHILE_REPLAYING && !self.gate.open() {
                return Ok(None);
            }
            let mut named = id_args(id).to_vec();
            named.push(("fp", Arg::Bytes(fingerprint)));
            let on = if D::PEEK_ON_HOT { On::Hot } else { On::Pool };
            let rows = self.rows(on, peek, &named).await?;
            let Some(row) = rows.first() else {
                return Ok(None);
            };
            if D::PEEK_WHILE_REPLAYING {
                self.gate.saw(true);
            }
            if !row.flag("same_fingerprint")? {
                return Ok(Some(Err(Mismatched)));
            }
            let outcome = outcome_from_sql(
                row.opt_bytes("outcome")?,
                row.flag("outcome_is_err")?,
                row.int("outcome_version")?,
            )?;
            Ok(Some(Ok(outcome)))
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            if let (true, Some(sql_epoch)) = (self.dialect.gathers(), sql_epoch(epoch)) {
                let op = Gathered::Record {
                    id: id.clone(),
                    epoch: sql_epoch,
                    outcome: outcome.clone(),
                    retain,
                    payload: wake_payload(id)?,
                };
                if let Some(rows) = self.dialect.gathered(op).await {
                    // A batch's own statement wakes its waiters; one issued alone does not.
                    let rows = rows.map_err(D::map_err)?;
                    self.wake_waiters(&rows, id).await;
                    return fence(&rows);
                }
            }
            self.write_outcome(&self.sql.record, id, epoch, outcome, retain)
                .await
        })
    }

    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let retain = [("retain_ms", Arg::Int(millis(retain)))];
            self.fenced(&self.sql.release, id, epoch, &retain).await
        })
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move { self.fenced(&self.sql.mark_unknown, id, epoch, &[]).await })
    }

    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let lease = [("lease_ms", Arg::Int(lease_millis(lease)))];
            self.fenced(&self.sql.renew, id, epoch, &lease).await
        })
    }

    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(async move {
            let step = [
                ("label", Arg::Text(label)),
                ("outcome", Arg::Bytes(&outcome.body)),
                ("is_err", Arg::Bool(outcome.is_err)),
                ("version", Arg::Int(i64::from(outcome.version))),
            ];
            self.fenced(&self.sql.record_step, id, epoch, &step).await
        })
    }

    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        StoreFuture::new(async move {
            // Read once by a claim that resumes, on the way to its body, like the replay read.
            let on = if D::PEEK_ON_HOT { On::Hot } else { On::Pool };
            let rows = self.rows(on, &self.sql.steps, &id_args(id)).await?;
            rows.iter()
                .map(|row| {
                    Ok(StepRecord {
                        label: row.text("label")?,
                        epoch: epoch_from_sql(row.int("epoch")?)?,
                        age: duration_ms(row.int("age_ms")?),
                        outcome: outcome_from_sql(
                            row.opt_bytes("outcome")?,
                            row.flag("outcome_is_err")?,
                            row.int("outcome_version")?,
                        )?,
                    })
                })
                .collect()
        })
    }

    fn announce_wait<'a>(&'a self, id: &'a OperationId) -> StoreFuture<'a, Result<(), StoreError>> {
        StoreFuture::new(async move {
            if let Some(stmt) = &self.sql.announce_wait {
                self.rows(On::Pool, stmt, &id_args(id)).await?;
            }
            Ok(())
        })
    }

    fn attach_wakers(&self, hub: std::sync::Arc<crate::store::WakeHub>) {
        self.dialect.attach_wakers(hub);
    }

    fn read_before_claims(&self) {
        self.gate.hold_open();
    }

    fn shares_claim_counts(&self) -> bool {
        self.sql.take_claim_token.is_some()
    }

    fn take_claim_token<'a>(
        &'a self,
        key: &'a str,
        burst: u32,
        every: Duration,
    ) -> StoreFuture<'a, Result<Option<Duration>, StoreError>> {
        let Some(stmt) = &self.sql.take_claim_token else {
            return StoreFuture::ready(Err(StoreError::new(
                false,
                "this database cannot hold a shared claim count; drop `ClaimLimit::shared` \
                 to count per process, or keep idem's records on PostgreSQL or Redis",
            )));
        };
        // Whole microseconds, at least one: the count's unit.
        let every_us = i64::try_from(every.as_micros()).unwrap_or(i64::MAX).max(1);
        let window_us = every_us.saturating_mul(i64::from(burst));
        StoreFuture::new(async move {
            let args = [
                ("key", Arg::Text(key)),
                ("every_us", Arg::Int(every_us)),
                ("window_us", Arg::Int(window_us)),
            ];
            let rows = self.rows(On::Pool, stmt, &args).await?;
            Ok(match rows.first() {
                Some(row) => match row.int("wait_us")? {
                    0 => None,
                    us => Some(Duration::from_micros(us.unsigned_abs())),
                },
                // Another caller's first claim under this key, committed after this
                // statement's snapshot: the key was just used, so wait one interval.
                None => Some(every),
            })
        })
    }
}

#[async_trait::async_trait]
impl<D: Dialect> Admin for SqlStore<D> {
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        match completed {
            None => {
                let window = [("retain_ms", Arg::Int(millis(crate::store::RESUME_WINDOW)))];
                self.fenced(&self.sql.resolve_delete, id, epoch, &window)
                    .await
            }
            Some((outcome, retain)) => {
                self.write_outcome(&self.sql.resolve_record, id, epoch, outcome, retain)
                    .await
            }
        }
    }

    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.fenced(&self.sql.forget, id, epoch, &[]).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        let mut purge = &self.sql.purge;
        loop {
            // A dialect whose clock function keeps the planner off the expiry index
            // compares against this bound value instead (SQLite: the same system clock).
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            let args = purge.args(&[
                ("limit", Arg::Int(PURGE_BATCH)),
                ("now_ms", Arg::Int(now_ms)),
            ])?;
            let n = match self.dialect.execute(purge, args).await {
                Ok(n) => n,
                // A row held by another transaction: the rest of this purge skips such
                // rows (a statement that ended on its wait limit deleted nothing).
                Err(e) => match &self.sql.purge_locked {
                    Some(locked) if D::is_lock_wait(&e) && !std::ptr::eq(purge, locked) => {
                        purge = locked;
                        continue;
                    }
                    _ => return Err(D::map_err(e)),
                },
            };
            total += n;
            // Skipping held rows, a short batch does not mean the end: a row may have
            // been held only a moment (the statement that ended on its wait limit can
            // still be releasing its own locks), so another pass follows until one
            // deletes nothing.
            let skipping = self
                .sql
                .purge_locked
                .as_ref()
                .is_some_and(|locked| std::ptr::eq(purge, locked));
            let done = if skipping {
                n == 0
            } else {
                n < PURGE_BATCH.unsigned_abs()
            };
            if done {
                // Counts whose allowance is whole again are what a missing row means.
                if let Some(stmt) = &self.sql.purge_claim_tokens {
                    self.rows(On::Pool, stmt, &[]).await?;
                }
                return Ok(total);
            }
        }
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut stats = Stats::default();
        for row in self.rows(On::Pool, &self.sql.stats, &[]).await? {
            let code = row.int("state")?;
            let n = u64::try_from(row.int("n")?).unwrap_or(0);
            let oldest = Some(duration_ms(row.int("oldest_ms")?));
            // stats.sql counts records released with their steps apart, as `RELEASED`.
            if code == RELEASED {
                stats.released = n;
                continue;
            }
            match State::from_code(code) {
                Some(State::InProgress) => {
                    (stats.in_progress, stats.oldest_in_progress) = (n, oldest)
                }
                Some(State::Completed) => stats.completed = n,
                Some(State::Unknown) => (stats.unknown, stats.oldest_unknown) = (n, oldest),
                None => return Err(corrupt(format!("unknown state code {code}"))),
            }
        }
        Ok(stats)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let named = [
            (
                "state",
                Arg::OptInt(filter.state.map(|s| i64::from(s.code()))),
            ),
            ("op_name", Arg::OptText(filter.name.as_deref())),
            ("op_scope", Arg::OptText(filter.scope.as_deref())),
            ("older_ms", Arg::OptInt(filter.older_than.map(millis))),
            ("newer_ms", Arg::OptInt(filter.newer_than.map(millis))),
            ("newest", Arg::Bool(filter.newest_first)),
            ("limit", Arg::Int(i64::from(filter.max_rows()))),
        ];
        let rows = self.rows(On::Pool, &self.sql.list, &named).await?;
        rows.iter().map(record_info).collect()
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let rows = self.rows(On::Pool, &self.sql.get, &id_args(id)).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        record_detail(
            id,
            row.int("state")?,
            row.int("epoch")?,
            row.int("age_ms")?,
            row.opt_int("lease_ms")?,
            row.opt_int("expires_ms")?,
            row.opt_bytes("outcome")?,
            row.flag("outcome_is_err")?,
            row.int("outcome_version")?,
        )
        .map(Some)
    }
}
