//! The `pg` bench's subjects: idem on its table, and the store's own SQL through sqlx.

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_runtime::{Idem, IdemError, KeyPart, OperationId, TxStep};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgPool, PgRow};
use sqlx::{Postgres, Row};

use crate::pg_config::{Config, quoted};
use crate::support::driver::Driven;
use crate::support::{FINGERPRINT, LEASE_MS, NAME, POOL, RETAIN_MS, Res, check};

/// The store's statements, rendered by the store's own engine from its `.sql` files.
pub struct Templates;

impl Templates {
    pub fn load() -> Res<Templates> {
        Ok(Templates)
    }

    pub fn render(&self, table: &str) -> Sql {
        let r = |name: &str| {
            idem_runtime::store::bench::postgres_statement(name, table)
                .expect("idem's statements render for the bench's table")
        };
        Sql {
            peek: r("peek"),
            claim: r("claim"),
            claim_fresh: r("claim_fresh"),
            record: r("record"),
            tx_claim: r("tx_claim"),
            tx_record: r("tx_record"),
            claim_batch: r("claim_batch"),
            record_batch: r("record_batch"),
        }
    }
}

/// The store's statements for one table.
#[derive(Clone)]
pub struct Sql {
    pub peek: String,
    pub claim: String,
    pub claim_fresh: String,
    pub record: String,
    pub tx_claim: String,
    pub tx_record: String,
    pub claim_batch: String,
    pub record_batch: String,
}

pub enum Side {
    Idem(Idem),
    /// The store's SQL through sqlx; `held`: on one connection per task instead of a
    /// pool acquire per statement.
    Sqlx {
        sql: Sql,
        held: bool,
    },
    /// Transactional mode's statements through sqlx, in a plain transaction; `savepoint`:
    /// with idem's savepoint around them.
    SqlxTx {
        sql: Sql,
        savepoint: bool,
    },
}

/// One side of a comparison: idem on its table, or the baseline's SQL on its own.
pub struct Subject {
    side: Side,
    pool: PgPool,
    pub table: String,
    /// `INSERT` of the business row, for the transactional phase.
    order: String,
    /// The next key index; keys are never reused within a table.
    seq: AtomicU64,
    /// Where this subject's fresh keys of the 50% mix start: subjects that share the
    /// replay table must not draw each other's.
    mix_base: u64,
    /// How many times the body ran (idem) or a claim was won (baseline).
    pub runs: AtomicU64,
}

#[derive(Clone, Copy)]
pub enum Phase {
    Fresh,
    /// Replays of the keys `from..from + keys`, recorded beforehand.
    Replay {
        from: u64,
        keys: u64,
    },
    Tx,
    /// Half replays of the keys `from..from + keys`, half fresh keys.
    Mix {
        from: u64,
        keys: u64,
    },
}

/// Where the mix's fresh keys start, past every key recorded to replay.
const MIX_FRESH: u64 = 1 << 40;
/// Subjects made so far, for their [`Subject::mix_base`].
static SUBJECTS: AtomicU64 = AtomicU64::new(0);

fn key(i: u64) -> String {
    format!("k{i}")
}

/// The body's error in transactional mode: idem's, or the business write's.
#[derive(Debug)]
enum TxError {
    Idem(IdemError),
    Sql(sqlx::Error),
}

impl From<IdemError> for TxError {
    fn from(e: IdemError) -> Self {
        TxError::Idem(e)
    }
}

impl std::fmt::Display for TxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TxError::Idem(e) => e.fmt(f),
            TxError::Sql(e) => e.fmt(f),
        }
    }
}

impl Error for TxError {}

type Query<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// idem on the bench's table, with lease renewal as asked and the in-process replay
/// cache off: the replay rows measure the store's path (a retry reaching the same
/// process would not reach the database at all).
fn idem_builder(renew: bool, table: &str) -> idem_runtime::IdemBuilder {
    Idem::builder()
        .table(table)
        .renew_leases(renew)
        .replay_cache_bytes(0)
}

impl Subject {
    pub async fn idem(
        cfg: &Config,
        pool: &PgPool,
        table: String,
        orders: &str,
    ) -> Res<Arc<Subject>> {
        Subject::idem_renewing(cfg.renew, pool, table, orders).await
    }

    pub async fn idem_renewing(
        renew: bool,
        pool: &PgPool,
        table: String,
        orders: &str,
    ) -> Res<Arc<Subject>> {
        let idem = idem_builder(renew, &table).pool(pool.clone()).await?;
        Ok(Subject::new(Side::Idem(idem), pool, table, orders))
    }

    /// idem as `Idem::postgres` builds it: claims and records on connections it holds
    /// itself, outside any sqlx pool (as many as the pools have).
    pub async fn idem_own(
        cfg: &Config,
        pool: &PgPool,
        table: String,
        orders: &str,
    ) -> Res<Arc<Subject>> {
        let idem = idem_builder(cfg.renew, &table)
            .max_connections(POOL)
            .postgres(&cfg.knobs.url)
            .await?;
        Ok(Subject::new(Side::Idem(idem), pool, table, orders))
    }

    pub fn sqlx(
        sql: &Templates,
        pool: &PgPool,
        table: String,
        orders: &str,
        held: bool,
    ) -> Arc<Subject> {
        let sql = sql.render(&table);
        Subject::new(Side::Sqlx { sql, held }, pool, table, orders)
    }

    pub fn new(side: Side, pool: &PgPool, table: String, orders: &str) -> Arc<Subject> {
        Arc::new(Subject {
            side,
            pool: pool.clone(),
            table,
            order: format!("INSERT INTO {} (id, qty) VALUES ($1, $2)", quoted(orders)),
            seq: AtomicU64::new(0),
            mix_base: MIX_FRESH + (SUBJECTS.fetch_add(1, Ordering::Relaxed) << 32),
            runs: AtomicU64::new(0),
        })
    }
}

impl Driven for Subject {
    type Phase = Phase;
    /// The connection a baseline with `held` runs on.
    type Held = Option<PoolConnection<Postgres>>;

    fn seq(&self) -> &AtomicU64 {
        &self.seq
    }

    async fn hold(&self) -> Res<Self::Held> {
        Ok(match self.side {
            Side::Sqlx { held: true, .. } => Some(self.pool.acquire().await?),
            _ => None,
        })
    }

    async fn call(&self, phase: Phase, i: u64, held: &mut Self::Held) -> Res<()> {
        let mut conn = held.as_deref_mut();
        let key = match phase {
            Phase::Replay { from, keys } => key(from + i % keys),
            Phase::Mix { from, keys } if i.is_multiple_of(2) => key(from + (i / 2) % keys),
            Phase::Mix { .. } => key(self.mix_base + i),
            Phase::Fresh | Phase::Tx => key(i),
        };
        match (&self.side, phase) {
            (Side::Idem(idem), Phase::Fresh | Phase::Replay { .. } | Phase::Mix { .. }) => {
                let got = idem
                    .operation(NAME, &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .run(|| async {
                        self.runs.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, IdemError>(1u32)
                    })
                    .await?;
                check(got == 1, "idem returned another outcome")
            }
            (Side::Idem(idem), Phase::Tx) => {
                let mut tx = self.pool.begin().await?;
                let step: TxStep<u32, TxError, _> = idem
                    .operation(NAME, &key)
                    .retain(std::time::Duration::from_secs(86_400))
                    .fingerprint_none()
                    .begin_tx(&mut tx)
                    .await?;
                let TxStep::Run(guard) = step else {
                    return Err("a fresh key was replayed".into());
                };
                let out: Result<u32, TxError> = async {
                    self.runs.fetch_add(1, Ordering::Relaxed);
                    sqlx::query(&self.order)
                        .bind(&key)
                        .bind(1_i64)
                        .execute(&mut *tx)
                        .await
                        .map_err(TxError::Sql)?;
                    Ok(1u32)
                }
                .await;
                guard.finish(&mut tx, out).await?;
                tx.commit().await?;
                Ok(())
            }
            (Side::Sqlx { sql, .. }, Phase::Fresh) => self.fresh(sql, &key, &mut conn).await,
            (Side::Sqlx { sql, .. }, Phase::Mix { .. }) if !i.is_multiple_of(2) => {
                self.fresh(sql, &key, &mut conn).await
            }
            (Side::Sqlx { sql, .. }, Phase::Replay { .. } | Phase::Mix { .. }) => {
                self.replay(sql, &key, &mut conn).await
            }
            (Side::SqlxTx { sql, savepoint }, _) => self.tx(sql, *savepoint, &key).await,
            (Side::Sqlx { .. }, Phase::Tx) => {
                let mut tx = self.pool.begin().await?;
                sqlx::query(&self.order)
                    .bind(&key)
                    .bind(1_i64)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }
        }
    }
}

impl Subject {
    async fn fetch(&self, query: Query<'_>, conn: &mut Option<&mut PgConnection>) -> Res<PgRow> {
        let row = match conn {
            Some(c) => query.fetch_optional(&mut **c).await?,
            None => query.fetch_optional(&self.pool).await?,
        };
        Ok(row.ok_or("the statement returned no row")?)
    }

    /// What idem does for a fresh key, minus idem: the claim of a new key (a plain
    /// insert), then the record.
    async fn fresh(&self, sql: &Sql, key: &str, conn: &mut Option<&mut PgConnection>) -> Res<()> {
        let id = operation_id(key);
        let claim = sqlx::query(&sql.claim_fresh)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..])
            .bind(LEASE_MS);
        let claim = self.fetch(claim, conn).await?;
        let epoch: i64 = claim.try_get("epoch")?;
        self.runs.fetch_add(1, Ordering::Relaxed);
        let record = sqlx::query(&sql.record)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(serde_json::to_vec(&1u32)?)
            .bind(false)
            .bind(1_i32)
            .bind(RETAIN_MS);
        let recorded = self.fetch(record, conn).await?;
        check(
            recorded.try_get::<i64, _>("held")? == 1,
            "the record was fenced",
        )
    }

    /// What idem does for a fresh key in transactional mode, minus idem.
    async fn tx(&self, sql: &Sql, savepoint: bool, key: &str) -> Res<()> {
        let id = operation_id(key);
        let mut tx = self.pool.begin().await?;
        if savepoint {
            sqlx::query("SAVEPOINT idem_body").execute(&mut *tx).await?;
        }
        let claimed = sqlx::query(&sql.tx_claim)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..])
            .bind(LEASE_MS)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(claimed) = claimed else {
            return check(false, "the transactional claim was not ours");
        };
        let epoch: i64 = claimed.try_get("epoch")?;
        self.runs.fetch_add(1, Ordering::Relaxed);
        sqlx::query(&self.order)
            .bind(key)
            .bind(1_i64)
            .execute(&mut *tx)
            .await?;
        let recorded = sqlx::query(&sql.tx_record)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(serde_json::to_vec(&1u32)?)
            .bind(false)
            .bind(1_i32)
            .bind(RETAIN_MS)
            .execute(&mut *tx)
            .await?;
        check(recorded.rows_affected() == 1, "the record found no claim")?;
        if savepoint {
            sqlx::query("RELEASE SAVEPOINT idem_body")
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// What idem does for a replay once replays come in, minus idem: the read of a
    /// completed record.
    async fn replay(&self, sql: &Sql, key: &str, conn: &mut Option<&mut PgConnection>) -> Res<()> {
        let id = operation_id(key);
        let peek = sqlx::query(&sql.peek)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&FINGERPRINT[..]);
        let row = self.fetch(peek, conn).await?;
        check(row.try_get::<bool, _>("same_fingerprint")?, "mismatch")?;
        let outcome: Vec<u8> = row.try_get("outcome")?;
        check(
            serde_json::from_slice::<u32>(&outcome)? == 1,
            "another outcome",
        )
    }
}

fn operation_id(key: &str) -> OperationId {
    OperationId {
        scope: String::new(),
        name: NAME.into(),
        key: key.encode_key(),
    }
}
