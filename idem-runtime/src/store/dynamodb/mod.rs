//! The store on Amazon DynamoDB (feature `dynamodb`): one item per operation, its steps
//! inside it, every state change a conditional write.
//!
//! # The table
//!
//! | attribute | type | what |
//! |---|---|---|
//! | `pk` | S, the partition key (no sort key) | a digest of the operation's scope, name and key |
//! | `sc`, `nm`, `ky` | S | the scope, name and key as stored (absent when empty) |
//! | `v` | N | the item's version: every write is conditional on the one read |
//! | `st`, `ep`, `fp` | N, N, B | state (0 in progress, 1 completed, 2 unknown), epoch, fingerprint |
//! | `lu`, `ca`, `xa` | N | lease end, claim time, expiry (ns since the UNIX epoch; `xa` absent while held) |
//! | `o`, `oe`, `ov` | B, BOOL, N | the outcome's body, whether it is an error, its version |
//! | `sp`, `sr` | L, BOOL | the steps of this life, and whether the claim was released with them |
//! | `expires_ttl` | N | `xa` in seconds plus five minutes, for DynamoDB's TTL |
//!
//! Create it with [`IdemBuilder::dynamodb`](crate::IdemBuilder::dynamodb) (on by
//! default: `CreateTable` with `pk` as its hash key, on-demand capacity, and TTL on
//! `expires_ttl`), or with your own IaC and `migrate(false)`. The IAM actions idem needs:
//! `dynamodb:GetItem`, `PutItem` and `DeleteItem` on every call path, `Scan` for the
//! operator's `list`, `stats` and `purge`, and `DescribeTable`, `CreateTable` and
//! `UpdateTimeToLive` for the creation.
//!
//! # How a call reaches it
//!
//! Every read is strongly consistent; no call path scans. A claim of a key with no item
//! is one `PutItem` conditional on `attribute_not_exists(pk)`; any other change reads
//! the item, decides as every store does (the contract's decision table, `record.rs`),
//! and writes conditional on the version it read, reading again when another writer
//! came first. Times are the caller's clock: keep the hosts' clocks synchronized (NTP),
//! as leases of a few seconds need. DynamoDB's TTL deletes expired items lazily, up to
//! days late: idem treats an expired item as absent itself, and
//! [`Idem::purge_expired`](crate::Idem::purge_expired) deletes them at once where
//! there is no TTL. An operation with its steps is one item, at most 400 KB: keep step
//! values small (record a reference) where an operation has many.

mod codec;
mod open;

pub(crate) use open::client_from_env;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::AttributeValue;

use super::record::{Record, Tick};
use super::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RESUME_WINDOW,
    RecordDetail, RecordInfo, State, Stats, StepRecord, Store, StoreError, StoreFuture,
    StoredOutcome,
};
use codec::{Item, errors};

/// How many times a change is tried again when another writer changed the item between
/// its read and its write.
const CAS_ATTEMPTS: usize = 32;

/// The store on a DynamoDB table. Open it with [`Idem::dynamodb`](crate::Idem::dynamodb)
/// or [`IdemBuilder::dynamodb`](crate::IdemBuilder::dynamodb); see the
/// [module](self) for the table and its permissions.
#[derive(Debug)]
pub struct DynamoStore {
    client: Client,
    table: String,
    /// The last epoch this process issued: epochs are the clock in µs, never below one
    /// issued before.
    last_epoch: AtomicU64,
}

/// What a change writes after its decision.
enum Write {
    /// Nothing: the answer came from the item as it was.
    Nothing,
    /// The record as changed.
    Put,
    /// The item goes.
    Delete,
}

fn now() -> Tick {
    let ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    Tick(u64::try_from(ns).unwrap_or(u64::MAX))
}

impl DynamoStore {
    /// The store on `table` through `client`; the table must exist (see
    /// [`IdemBuilder::dynamodb`](crate::IdemBuilder::dynamodb), which creates it).
    pub fn new(client: Client, table: impl Into<String>) -> DynamoStore {
        DynamoStore {
            client,
            table: table.into(),
            last_epoch: AtomicU64::new(0),
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// An epoch above `floor` and every one this process issued: the clock in µs.
    fn next_epoch(&self, now: Tick, floor: u64) -> u64 {
        let clock = now.0 / 1000;
        let mut issued = 0;
        let _ = self
            .last_epoch
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                issued = clock.max(last + 1).max(floor + 1);
                Some(issued)
            });
        issued
    }

    async fn read(&self, id: &OperationId) -> Result<Option<Item>, StoreError> {
        let got = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(codec::pk(id)))
            .consistent_read(true)
            .send()
            .await
            .map_err(errors::store)?;
        got.item.map(|item| Item::decode(&item)).transpose()
    }

    /// Writes `rec` for `id` if the item is still at `version` (absent for `None`);
    /// `false` when another writer came first.
    async fn put(
        &self,
        id: &OperationId,
        rec: &Record,
        version: Option<u64>,
    ) -> Result<bool, StoreError> {
        let next = version.map_or(1, |v| v + 1);
        let put = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(codec::encode(id, rec, next)));
        let put = match version {
            None => put.condition_expression("attribute_not_exists(pk)"),
            Some(v) => put
                .condition_expression("v = :v")
                .expression_attribute_values(":v", AttributeValue::N(v.to_string())),
        };
        match put.send().await {
            Ok(_) => Ok(true),
            Err(e) if errors::lost_race(&e) => Ok(false),
            Err(e) => Err(errors::store(e)),
        }
    }

    /// Deletes `id`'s item if it is still at `version`; `false` when it is not.
    async fn delete(&self, id: &OperationId, version: u64) -> Result<bool, StoreError> {
        let deleted = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(codec::pk(id)))
            .condition_expression("v = :v")
            .expression_attribute_values(":v", AttributeValue::N(version.to_string()))
            .send()
            .await;
        match deleted {
            Ok(_) => Ok(true),
            Err(e) if errors::lost_race(&e) => Ok(false),
            Err(e) => Err(errors::store(e)),
        }
    }

    /// Reads `id`'s record, lets `decide` answer and change it, and writes what it says,
    /// conditional on the version read; again from the read when another writer came
    /// first.
    async fn change<T>(
        &self,
        id: &OperationId,
        mut decide: impl FnMut(&mut Option<Record>, Tick) -> (T, Write),
    ) -> Result<T, StoreError> {
        for _ in 0..CAS_ATTEMPTS {
            let item = self.read(id).await?;
            let version = item.as_ref().map(|i| i.version);
            let mut rec = item.map(|i| i.rec);
            let (answer, write) = decide(&mut rec, now());
            let done = match (write, rec, version) {
                (Write::Nothing, ..) => true,
                (Write::Put, Some(rec), version) => self.put(id, &rec, version).await?,
                (Write::Delete, _, Some(version)) => self.delete(id, version).await?,
                (Write::Put | Write::Delete, ..) => true,
            };
            if done {
                return Ok(answer);
            }
        }
        Err(StoreError::new(
            true,
            format!(
                "the item of operation `{}` changed under {CAS_ATTEMPTS} writes in a row; retry",
                id.name
            ),
        ))
    }

    /// A fenced change: `f` runs on the record if `holds` says the claim of `epoch`
    /// holds it, and says what to write.
    async fn fenced(
        &self,
        id: &OperationId,
        epoch: u64,
        holds: fn(&Record, u64) -> bool,
        f: impl Fn(&mut Record, Tick) -> Write,
    ) -> Result<Fence, StoreError> {
        self.change(id, |rec, now| match rec {
            Some(r) if holds(r, epoch) => (Fence::Held, f(r, now)),
            _ => (Fence::Lost, Write::Nothing),
        })
        .await
    }

    /// Every operation's item, for the operator's calls (a scan).
    async fn scan(&self) -> Result<Vec<(OperationId, Item)>, StoreError> {
        let mut out = Vec::new();
        let mut start = None;
        loop {
            let page = self
                .client
                .scan()
                .table_name(&self.table)
                .consistent_read(true)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(errors::store)?;
            for item in page.items() {
                if codec::is_meta(item) {
                    continue;
                }
                out.push((codec::id_of(item)?, Item::decode(item)?));
            }
            match page.last_evaluated_key {
                Some(key) if !key.is_empty() => start = Some(key),
                _ => return Ok(out),
            }
        }
    }
}

/// The item's release: it goes unless it has steps, which it keeps, released.
fn release(rec: &mut Record, expires_at: Tick) -> Write {
    if rec.release(expires_at) {
        Write::Delete
    } else {
        Write::Put
    }
}

impl Store for DynamoStore {
    fn claim<'a>(
        &'a self,
        req: &'a ClaimRequest<'a>,
    ) -> StoreFuture<'a, Result<Claim, StoreError>> {
        StoreFuture::new(async move {
            // A key with no item: one conditional put, no read.
            let now = now();
            let fresh = Record::fresh(req, now, self.next_epoch(now, 0));
            if self.put(req.id, &fresh, None).await? {
                return Ok(Claim::Acquired {
                    epoch: fresh.epoch,
                    takeover: false,
                    resume: false,
                });
            }
            self.change(req.id, |rec, now| match rec {
                None => {
                    let fresh = Record::fresh(req, now, self.next_epoch(now, 0));
                    let epoch = fresh.epoch;
                    *rec = Some(fresh);
                    let claim = Claim::Acquired {
                        epoch,
                        takeover: false,
                        resume: false,
                    };
                    (claim, Write::Put)
                }
                Some(r) => {
                    let floor = r.epoch;
                    let claim = r.claim(req, now, || self.next_epoch(now, floor));
                    let write = match claim {
                        Claim::Acquired { .. } | Claim::Unknown { now: true, .. } => Write::Put,
                        _ => Write::Nothing,
                    };
                    (claim, write)
                }
            })
            .await
        })
    }

    fn peek_completed<'a>(
        &'a self,
        id: &'a OperationId,
        fingerprint: &'a [u8; 32],
    ) -> StoreFuture<'a, Result<Option<Result<StoredOutcome, Mismatched>>, StoreError>> {
        StoreFuture::new(async move {
            let item = self.read(id).await?;
            Ok(item.and_then(|i| i.rec.peek(fingerprint, now())))
        })
    }

    fn record<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        outcome: &'a StoredOutcome,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(self.change(id, move |rec, now| {
            let expires_at = now.after(retain);
            match rec
                .as_mut()
                .and_then(|r| r.record(epoch, outcome, expires_at))
            {
                Some(true) => (Fence::Held, Write::Put),
                Some(false) => (Fence::Held, Write::Nothing),
                None => (Fence::Lost, Write::Nothing),
            }
        }))
    }

    fn release<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        retain: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(self.fenced(id, epoch, Record::held_by, move |r, now| {
            release(r, now.after(retain))
        }))
    }

    fn mark_unknown<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(self.fenced(id, epoch, Record::held_by, |r, _| {
            r.state = State::Unknown;
            Write::Put
        }))
    }

    fn renew<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        lease: Duration,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(self.fenced(id, epoch, Record::held_by, move |r, now| {
            r.lease_until = now.after(lease);
            Write::Put
        }))
    }

    fn record_step<'a>(
        &'a self,
        id: &'a OperationId,
        epoch: u64,
        label: &'a str,
        outcome: &'a StoredOutcome,
    ) -> StoreFuture<'a, Result<Fence, StoreError>> {
        StoreFuture::new(self.change(id, move |rec, now| {
            match rec
                .as_mut()
                .is_some_and(|r| r.record_step(epoch, label, outcome, now))
            {
                true => (Fence::Held, Write::Put),
                false => (Fence::Lost, Write::Nothing),
            }
        }))
    }

    fn steps<'a>(
        &'a self,
        id: &'a OperationId,
    ) -> StoreFuture<'a, Result<Vec<StepRecord>, StoreError>> {
        StoreFuture::new(async move {
            let item = self.read(id).await?;
            Ok(item.map_or_else(Vec::new, |i| i.rec.steps(now())))
        })
    }
}

#[async_trait::async_trait]
impl Admin for DynamoStore {
    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        self.fenced(id, epoch, Record::settles_at, |r, now| match completed {
            None => release(r, now.after(RESUME_WINDOW)),
            Some((outcome, retain)) => {
                r.complete(outcome.clone(), now.after(retain));
                Write::Put
            }
        })
        .await
    }

    async fn forget(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.change(id, |rec, now| match rec {
            Some(r) if r.epoch == epoch && r.forgettable(now) => (Fence::Held, Write::Delete),
            _ => (Fence::Lost, Write::Nothing),
        })
        .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = now();
        let mut purged = 0;
        for (id, item) in self.scan().await? {
            // An item claimed afresh since the scan is at another version: kept.
            if item.rec.expired(now) && self.delete(&id, item.version).await? {
                purged += 1;
            }
        }
        Ok(purged)
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let now = now();
        let mut s = Stats::default();
        for (_, item) in self.scan().await? {
            let r = &item.rec;
            s.count(r.state, r.released(), now.since(r.claimed_at));
        }
        Ok(s)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let now = now();
        let mut rows: Vec<RecordInfo> = self
            .scan()
            .await?
            .into_iter()
            .filter(|(id, item)| {
                item.rec.listed(filter, now)
                    && filter.name.as_deref().is_none_or(|n| n == id.name)
                    && filter.scope.as_deref().is_none_or(|s| s == id.scope)
            })
            .map(|(id, item)| item.rec.info(id, now))
            .collect();
        super::sort_listed(&mut rows, filter);
        Ok(rows)
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let item = self.read(id).await?;
        Ok(item.map(|i| i.rec.detail(id.clone(), now())))
    }
}
