//! The embedded store: one SQLite table, a file in WAL mode or a pinned in-memory database.
//!
//! Every method is one statement. Times come from SQLite's clock inside the statement
//! (`unixepoch('subsec')`, fixed for the whole statement), never from the application.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::str::FromStr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Executor, Row};

use super::sql_common::{
    self, ClaimRow, Decision, SqlOptions, TableName, TxClaim, TxRow, corrupt, decide, duration_ms,
    epoch_from_sql, millis, outcome_from_sql, sql_epoch,
};
use super::{
    Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail, RecordInfo,
    State, Stats, Store, StoredOutcome, Takeover,
};
use crate::error::{IdemError, StoreError};

/// The store's clock in unix milliseconds. SQLite fixes `'now'` for the duration of one
/// `sqlite3_step`, so every use within a statement sees the same instant.
const NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// How long a statement waits for another connection's write lock before `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

use sql_common::SQLITE_MIGRATIONS as MIGRATIONS;

/// The epoch a claim takes: one above every epoch this table ever issued (the claim's
/// own statement raises `last_epoch` through the table's triggers).
const NEXT_EPOCH: &str = "(SELECT last_epoch + 1 FROM {meta} WHERE id = 0)";

/// idem's own migration bookkeeping, one row per (table, version); never sqlx's
/// `_sqlx_migrations`, which belongs to the application.
const BOOKKEEPING_DDL: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
    table_name TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    applied_at INTEGER NOT NULL,
    PRIMARY KEY (table_name, version)
)";

const TABLE_EXISTS: &str = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1";

const FORGET_MIGRATIONS: &str = "DELETE FROM idem_schema_migrations WHERE table_name = ?1";

const APPLIED_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations WHERE table_name = ?1";

const RECORD_MIGRATION: &str =
    "INSERT INTO idem_schema_migrations (table_name, version, applied_at) VALUES (?1, ?2, {now})";

/// Reads every column idem uses, so a missing or foreign table fails at open, not at the
/// first claim.
const PROBE: &str = "SELECT scope, name, key, state, epoch, fingerprint, token, taken_over,
    lease_until_ms, created_ms, claimed_ms, expires_ms, outcome, outcome_is_err, outcome_version,
    (SELECT last_epoch FROM {meta} WHERE id = 0) AS last_epoch
    FROM {table} LIMIT 0";

const SET_KEY_MODE: &str = "UPDATE {meta} SET key_mode = ?1 WHERE id = 0 AND key_mode IS NULL";
const GET_KEY_MODE: &str = "SELECT key_mode FROM {meta} WHERE id = 0";

/// The record is COMPLETED and its retention has passed: it counts as absent, so the
/// claim starts afresh (new fingerprint, a new epoch so stale writers stay fenced).
const EXPIRED: &str = "(cur.state = 1 AND cur.expires_ms <= excluded.claimed_ms)";

/// The record is IN_PROGRESS, its lease has lapsed, and it is the same request: another
/// caller may take it over. A different request never takes over (that is a mismatch).
const LAPSED: &str = "(cur.state = 0 AND cur.lease_until_ms <= excluded.claimed_ms \
                      AND cur.fingerprint = excluded.fingerprint)";

/// The claim: one atomic upsert that decides everything.
///
/// Parameters: ?1 scope, ?2 name, ?3 key, ?4 fingerprint, ?5 this attempt's token,
/// ?6 lease (ms), ?7 whether a lapsed lease goes to UNKNOWN.
///
/// A missing row is inserted as a fresh claim with the next epoch. On conflict, `DO UPDATE` always
/// runs (SQLite returns no row for an upsert that does nothing, which would force a
/// second statement), but every column keeps its old value unless the old row is
/// claimable, so an unclaimable row is rewritten unchanged:
///
/// | old row                         | `{rerun}` / `{to_unknown}` | new row                       |
/// |---------------------------------|----------------------------|-------------------------------|
/// | COMPLETED, expired              | —                          | fresh claim, next epoch, new fp |
/// | IN_PROGRESS, lapsed, same fp    | rerun                      | takeover: next epoch, new lease |
/// | IN_PROGRESS, lapsed, same fp    | to_unknown                 | UNKNOWN, same epoch           |
/// | anything else                   | —                          | unchanged                     |
///
/// `excluded.claimed_ms` is the statement's `now`. RETURNING shows the row after the
/// statement; `token = ?5` says whether this statement wrote it (the token column takes
/// the new token exactly when the row was claimed or moved to UNKNOWN), and
/// `taken_over` tells a takeover from a fresh claim. [`decide`] reads the rest.
const CLAIM: &str = "INSERT INTO {table} AS cur (scope, name, key, state, epoch, fingerprint,
        token, taken_over, lease_until_ms, created_ms, claimed_ms, expires_ms, outcome,
        outcome_is_err, outcome_version)
    VALUES (?1, ?2, ?3, 0, {next_epoch}, ?4, ?5, 0, {now} + ?6, {now}, {now}, NULL, NULL, 0, 0)
    ON CONFLICT (scope, name, key) DO UPDATE SET
        state = CASE WHEN {expired} OR {rerun} THEN 0 WHEN {to_unknown} THEN 2
                     ELSE cur.state END,
        epoch = CASE WHEN {expired} OR {rerun} THEN excluded.epoch ELSE cur.epoch END,
        fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE cur.fingerprint END,
        token = CASE WHEN {expired} OR {lapsed} THEN excluded.token ELSE cur.token END,
        taken_over = CASE WHEN {expired} THEN 0 WHEN {rerun} THEN 1 ELSE cur.taken_over END,
        lease_until_ms = CASE WHEN {expired} OR {rerun} THEN excluded.lease_until_ms
                              ELSE cur.lease_until_ms END,
        created_ms = CASE WHEN {expired} THEN excluded.created_ms ELSE cur.created_ms END,
        claimed_ms = CASE WHEN {expired} OR {rerun} THEN excluded.claimed_ms
                          ELSE cur.claimed_ms END,
        expires_ms = CASE WHEN {expired} THEN NULL ELSE cur.expires_ms END,
        outcome = CASE WHEN {expired} THEN NULL ELSE cur.outcome END,
        outcome_is_err = CASE WHEN {expired} THEN 0 ELSE cur.outcome_is_err END,
        outcome_version = CASE WHEN {expired} THEN 0 ELSE cur.outcome_version END
    RETURNING token = ?5 AS mine, state, epoch, fingerprint = ?4 AS same_fingerprint,
        taken_over, lease_until_ms - {now} AS retry_after_ms, outcome, outcome_is_err,
        outcome_version";

/// The replay fast path: read-only. ?1..?3 the operation, ?4 the fingerprint.
const PEEK: &str = "SELECT fingerprint = ?4 AS same_fingerprint,
        CASE WHEN fingerprint = ?4 THEN outcome END AS outcome, outcome_is_err, outcome_version
    FROM {table}
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND state = 1 AND expires_ms > {now}";

/// ?1..?3 the operation, ?4 epoch, ?5 outcome, ?6 is_err, ?7 version, ?8 retain (ms).
///
/// The same outcome already recorded at the same epoch also holds: that is this record
/// retried after its first attempt committed but its reply was lost.
const RECORD: &str = "UPDATE {table}
    SET state = 1, outcome = ?5, outcome_is_err = ?6, outcome_version = ?7,
        expires_ms = CASE WHEN state = 0 THEN {now} + ?8 ELSE expires_ms END
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND epoch = ?4
      AND (state = 0 OR (state = 1 AND outcome = ?5 AND outcome_is_err = ?6
                         AND outcome_version = ?7))";

const RELEASE: &str = "DELETE FROM {table}
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND epoch = ?4 AND state = 0";

const MARK_UNKNOWN: &str = "UPDATE {table} SET state = 2
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND epoch = ?4 AND state = 0";

/// ?5 the new lease (ms).
const RENEW: &str = "UPDATE {table} SET lease_until_ms = {now} + ?5
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND epoch = ?4 AND state = 0";

/// Parameters as [`RECORD`]; also settles an UNKNOWN record.
const RESOLVE_RECORD: &str = "UPDATE {table}
    SET state = 1, outcome = ?5, outcome_is_err = ?6, outcome_version = ?7,
        expires_ms = {now} + ?8
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND epoch = ?4 AND state IN (0, 2)";

const RESOLVE_DELETE: &str = "DELETE FROM {table}
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND epoch = ?4 AND state IN (0, 2)";

/// Records purged per statement, so a large purge does not hold the write lock for long.
const PURGE_BATCH: i64 = 1000;

/// ?1 the batch size.
const PURGE: &str = "DELETE FROM {table} WHERE rowid IN (
    SELECT rowid FROM {table} WHERE state = 1 AND expires_ms <= {now} LIMIT ?1)";

const STATS: &str = "SELECT state, count(*) AS n, max(0, {now} - min(claimed_ms)) AS oldest_ms
    FROM {table} GROUP BY state";

/// ?1 state or NULL, ?2 name or NULL, ?3 minimum age (ms) or NULL, ?4 limit.
const LIST: &str = "SELECT scope, name, key, state, epoch, max(0, {now} - claimed_ms) AS age_ms
    FROM {table}
    WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR name = ?2)
      AND (?3 IS NULL OR claimed_ms <= {now} - ?3)
    ORDER BY claimed_ms, scope, name, key
    LIMIT ?4";

/// One record in full. ?1..?3 the operation.
const GET: &str = "SELECT scope, name, key, state, epoch, max(0, {now} - claimed_ms) AS age_ms,
        max(0, lease_until_ms - {now}) AS lease_ms, max(0, expires_ms - {now}) AS expires_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = ?1 AND name = ?2 AND key = ?3";

/// Transactional mode: the claim inside the caller's transaction. The transaction's write
/// lock is the claim; the lease only matters if the caller commits without finishing
/// (a cancelled body), so the claim lapses like a leased one. ?1..?3 the operation, ?4
/// the fingerprint, ?5 the lease (ms).
const TX_CLAIM: &str = "INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, token,
        taken_over, lease_until_ms, created_ms, claimed_ms)
    VALUES (?1, ?2, ?3, 0, {next_epoch}, ?4, 0, 0, {now} + ?5, {now}, {now})
    ON CONFLICT (scope, name, key) DO NOTHING
    RETURNING epoch";

/// Transactional mode: the row that made [`TX_CLAIM`] do nothing.
const TX_READ: &str = "SELECT state, epoch, fingerprint = ?4 AS same_fingerprint,
        state = 1 AND expires_ms <= {now} AS expired,
        state = 0 AND lease_until_ms <= {now} AS lapsed,
        max(0, lease_until_ms - {now}) AS retry_after_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = ?1 AND name = ?2 AND key = ?3";

/// Transactional mode: an expired COMPLETED record counts as absent; claim it afresh.
const TX_RECLAIM_EXPIRED: &str = "UPDATE {table}
    SET state = 0, epoch = {next_epoch}, fingerprint = ?4, token = 0, taken_over = 0,
        lease_until_ms = {now} + ?5, created_ms = {now}, claimed_ms = {now}, expires_ms = NULL,
        outcome = NULL, outcome_is_err = 0, outcome_version = 0
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND state = 1 AND expires_ms <= {now}
    RETURNING epoch";

/// Transactional mode: a lapsed claim of the same request is taken over, as a leased
/// claim would be. ?5 the lease (ms).
const TX_TAKEOVER: &str = "UPDATE {table}
    SET epoch = {next_epoch}, token = 0, taken_over = 1, lease_until_ms = {now} + ?5,
        claimed_ms = {now}
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND state = 0 AND lease_until_ms <= {now}
      AND fingerprint = ?4
    RETURNING epoch";

/// Transactional mode: ?4 outcome, ?5 is_err, ?6 version, ?7 retain (ms).
const TX_RECORD: &str = "UPDATE {table}
    SET state = 1, outcome = ?4, outcome_is_err = ?5, outcome_version = ?6,
        expires_ms = {now} + ?7
    WHERE scope = ?1 AND name = ?2 AND key = ?3 AND state = 0";

/// Every statement, rendered once for the configured table.
#[derive(Debug)]
struct Statements {
    claim: String,
    peek: String,
    record: String,
    release: String,
    mark_unknown: String,
    renew: String,
    resolve_record: String,
    resolve_delete: String,
    purge: String,
    stats: String,
    list: String,
    get: String,
    tx_claim: String,
    tx_read: String,
    tx_reclaim: String,
    tx_takeover: String,
    tx_record: String,
}

impl Statements {
    fn new(table: &TableName) -> Statements {
        let r = |sql: &str| table.render(&sql.replace("{next_epoch}", NEXT_EPOCH), NOW_MS);
        let claim = CLAIM
            .replace("{rerun}", &format!("({LAPSED} AND NOT ?7)"))
            .replace("{to_unknown}", &format!("({LAPSED} AND ?7)"))
            .replace("{lapsed}", LAPSED)
            .replace("{expired}", EXPIRED);
        Statements {
            claim: r(&claim),
            peek: r(PEEK),
            record: r(RECORD),
            release: r(RELEASE),
            mark_unknown: r(MARK_UNKNOWN),
            renew: r(RENEW),
            resolve_record: r(RESOLVE_RECORD),
            resolve_delete: r(RESOLVE_DELETE),
            purge: r(PURGE),
            stats: r(STATS),
            list: r(LIST),
            get: r(GET),
            tx_claim: r(TX_CLAIM),
            tx_read: r(TX_READ),
            tx_reclaim: r(TX_RECLAIM_EXPIRED),
            tx_takeover: r(TX_TAKEOVER),
            tx_record: r(TX_RECORD),
        }
    }
}

/// The SQLite [`Store`]: a pool over one database and the statements for its table.
#[derive(Debug)]
pub(crate) struct SqliteStore {
    pool: SqlitePool,
    sql: Statements,
}

/// Opens (creating if missing) the database at `url` — `sqlite://path`, `sqlite:path`,
/// a bare path, or `sqlite::memory:` — and the idem table in it.
pub(crate) async fn open(url: &str, opts: &SqlOptions) -> Result<SqliteStore, IdemError> {
    let table = TableName::parse(&opts.table, false)?;
    let memory = is_memory(url);
    let mut connect = if url.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(url).map_err(|e| IdemError::Config {
            message: format!(
                "invalid SQLite URL `{url}`: {e}; expected `sqlite://path/to/file.db`, \
                 `sqlite::memory:` or a file path"
            ),
        })?
    } else {
        SqliteConnectOptions::new().filename(url)
    };
    // Create the file unless the URL chose a mode itself (`mode=rw` means "must exist").
    if !url.contains("mode=") {
        connect = connect.create_if_missing(true);
    }
    // FULL, not WAL's usual NORMAL: under NORMAL a power loss can drop the last
    // commits, and a lost claim or record lets a retry run the body a second time.
    connect = connect
        .busy_timeout(BUSY_TIMEOUT)
        .synchronous(SqliteSynchronous::Full);
    let pool = if memory {
        // An in-memory database lives as long as a connection to it. sqlx gives
        // `sqlite::memory:` a unique shared-cache name, so every connection of this pool
        // would see it, but a pool closes idle connections, and the database would vanish
        // with the last one. One connection, opened at once and never retired, keeps it
        // alive for the life of the store (and avoids shared-cache table locks).
        SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .test_before_acquire(false)
            .connect_with(connect)
            .await
    } else {
        // WAL lets readers (the replay fast path) run beside the one writer.
        SqlitePoolOptions::new()
            .test_before_acquire(false)
            .connect_with(connect.journal_mode(SqliteJournalMode::Wal))
            .await
    }
    .map_err(|e| IdemError::Config {
        message: format!(
            "cannot open SQLite database at `{url}`: {e}; check the path exists and is writable"
        ),
    })?;
    prepare(pool, table, opts).await
}

/// Uses an application's pool; creates the idem table in it unless `opts.migrate` is false.
pub(crate) async fn from_pool(
    pool: SqlitePool,
    opts: &SqlOptions,
) -> Result<SqliteStore, IdemError> {
    let table = TableName::parse(&opts.table, false)?;
    prepare(pool, table, opts).await
}

fn is_memory(url: &str) -> bool {
    let path = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    path == ":memory:" || query.split('&').any(|p| p == "mode=memory")
}

async fn prepare(
    pool: SqlitePool,
    table: TableName,
    opts: &SqlOptions,
) -> Result<SqliteStore, IdemError> {
    if opts.migrate {
        run_migrations(&pool, &table).await.map_err(|e| {
            open_error(
                e,
                format!(
                    "cannot create the idem table `{table}` in SQLite; check the database is \
                     writable, or create it yourself with `SQLITE_SCHEMA_SQL` and disable migrate"
                ),
            )
        })?;
    }
    let probe = table.render(PROBE, NOW_MS);
    sqlx::query(&probe).execute(&pool).await.map_err(|e| {
        open_error(
            e,
            format!(
                "the idem table `{table}` is missing or lacks idem's columns; create it with \
                     `SQLITE_SCHEMA_SQL` (renamed to `{table}`) or enable migrate"
            ),
        )
    })?;
    let recorded = record_key_mode(&pool, &table, &opts.key_mode)
        .await
        .map_err(|e| open_error(e, format!("cannot read the key mode of `{table}`")))?;
    sql_common::check_key_mode(&table, recorded, &opts.key_mode)?;
    let sql = Statements::new(&table);
    Ok(SqliteStore { pool, sql })
}

/// Records `mode` as the table's key mode unless one is recorded; returns the recorded one.
async fn record_key_mode(
    pool: &SqlitePool,
    table: &TableName,
    mode: &str,
) -> Result<Option<String>, sqlx::Error> {
    let set = table.render(SET_KEY_MODE, NOW_MS);
    sqlx::query(&set).bind(mode).execute(pool).await?;
    let get = table.render(GET_KEY_MODE, NOW_MS);
    sqlx::query_scalar(&get).fetch_one(pool).await
}

/// Applies the missing migrations under `BEGIN IMMEDIATE`, which takes the write lock at
/// once: processes opening the same file together apply them one after another (each
/// waits up to the busy timeout), and the later ones find nothing left to do.
async fn run_migrations(pool: &SqlitePool, table: &TableName) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    tx.execute(BOOKKEEPING_DDL).await?;
    let exists = sqlx::query(TABLE_EXISTS)
        .bind(table.bare())
        .fetch_optional(&mut *tx)
        .await?
        .is_some();
    if !exists {
        // The table was dropped since: its bookkeeping no longer describes anything.
        sqlx::query(FORGET_MIGRATIONS)
            .bind(table.bare())
            .execute(&mut *tx)
            .await?;
    }
    let applied: Vec<i64> = sqlx::query_scalar(APPLIED_MIGRATIONS)
        .bind(table.bare())
        .fetch_all(&mut *tx)
        .await?;
    let record_migration = table.render(RECORD_MIGRATION, NOW_MS);
    for &(version, ddl) in MIGRATIONS {
        if applied.contains(&version) {
            continue;
        }
        let ddl = table.render_ddl(ddl);
        tx.execute(ddl.as_str()).await?;
        sqlx::query(&record_migration)
            .bind(table.bare())
            .bind(version)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// An error while opening: transient ones (busy) are retryable store errors, the rest are
/// configuration to fix.
fn open_error(e: sqlx::Error, what: String) -> IdemError {
    let e = map_err(e);
    if e.retryable {
        IdemError::store(
            "opening the SQLite store",
            StoreError::new(true, format!("{what}: {}", e.source)),
        )
    } else {
        IdemError::Config {
            message: format!("{what}: {}", e.source),
        }
    }
}

/// SQLite's primary result codes (the low byte of the extended code) that a retry can
/// clear: SQLITE_BUSY (5), SQLITE_LOCKED (6), SQLITE_PROTOCOL (15, a WAL lock race).
fn retryable_code(code: &str) -> bool {
    code.parse::<i32>()
        .is_ok_and(|c| matches!(c & 0xff, 5 | 6 | 15))
}

/// SQLite's primary result codes that mean the database cannot be reached at all:
/// SQLITE_IOERR (10) and SQLITE_CANTOPEN (14).
fn unreachable_code(code: &str) -> bool {
    code.parse::<i32>()
        .is_ok_and(|c| matches!(c & 0xff, 10 | 14))
}

/// Maps a driver error to a [`StoreError`], retryable when a retry can clear it.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    sql_common::map_sqlx(e, retryable_code, unreachable_code)
}

/// A fresh token per claim attempt: distinct within the process (a bijective mix of a
/// counter), and unpredictable across processes (seeded from the OS-keyed `RandomState`,
/// the process id and the start time). The current process id is mixed into every
/// token, so a forked child, which inherits the seed and the counter, draws another
/// stream. Only equality with the row's token matters.
fn claim_token() -> i64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // SplitMix64: a bijection of seed + n·γ, so no two attempts of this process collide.
    let pid = u64::from(std::process::id()).wrapping_mul(0xd6e8_feb8_6659_fd93);
    let mut z = (seed ^ pid).wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    i64::from_ne_bytes((z ^ (z >> 31)).to_ne_bytes())
}

fn claim_row(row: &SqliteRow) -> Result<ClaimRow, sqlx::Error> {
    Ok(ClaimRow {
        mine: row.try_get("mine")?,
        stale: false,
        state: row.try_get("state")?,
        epoch: row.try_get("epoch")?,
        same_fingerprint: row.try_get("same_fingerprint")?,
        taken_over: row.try_get("taken_over")?,
        retry_after_ms: row.try_get("retry_after_ms")?,
        outcome: row.try_get("outcome")?,
        outcome_is_err: row.try_get("outcome_is_err")?,
        outcome_version: row.try_get("outcome_version")?,
    })
}

fn fence(rows: u64) -> Fence {
    if rows == 0 { Fence::Lost } else { Fence::Held }
}

impl SqliteStore {
    /// One fenced statement over `(scope, name, key, epoch)` that reports whether it hit.
    async fn fenced(&self, sql: &str, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        let Some(epoch) = sql_epoch(epoch) else {
            return Ok(Fence::Lost);
        };
        let done = sqlx::query(sql)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(fence(done.rows_affected()))
    }

    async fn write_outcome(
        &self,
        sql: &str,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        let Some(epoch) = sql_epoch(epoch) else {
            return Ok(Fence::Lost);
        };
        let done = sqlx::query(sql)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(&outcome.body)
            .bind(outcome.is_err)
            .bind(i64::from(outcome.version))
            .bind(millis(retain))
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(fence(done.rows_affected()))
    }
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let row = sqlx::query(&self.sql.claim)
            .bind(&req.id.scope)
            .bind(&req.id.name)
            .bind(&req.id.key)
            .bind(&req.fingerprint[..])
            .bind(claim_token())
            .bind(millis(req.lease))
            .bind(req.on_takeover == Takeover::Unknown)
            .fetch_one(&self.pool)
            .await
            .map_err(map_err)?;
        match decide(claim_row(&row).map_err(map_err)?)? {
            Decision::Claim(claim) => Ok(claim),
            // Writes are serialized and RETURNING shows this statement's own result, so
            // a row that is not ours is never claimable.
            Decision::Reissue => Err(corrupt("the claim returned a claimable row".to_owned())),
        }
    }

    async fn peek_completed(
        &self,
        id: &OperationId,
        fingerprint: &[u8; 32],
    ) -> Result<Option<Result<StoredOutcome, Mismatched>>, StoreError> {
        let Some(row) = sqlx::query(&self.sql.peek)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(&fingerprint[..])
            .fetch_optional(&self.pool)
            .await
            .map_err(map_err)?
        else {
            return Ok(None);
        };
        let same: bool = row.try_get("same_fingerprint").map_err(map_err)?;
        if !same {
            return Ok(Some(Err(Mismatched)));
        }
        let outcome = outcome_from_sql(
            row.try_get("outcome").map_err(map_err)?,
            row.try_get("outcome_is_err").map_err(map_err)?,
            row.try_get("outcome_version").map_err(map_err)?,
        )?;
        Ok(Some(Ok(outcome)))
    }

    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        self.write_outcome(&self.sql.record, id, epoch, outcome, retain)
            .await
    }

    async fn release(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.fenced(&self.sql.release, id, epoch).await
    }

    async fn mark_unknown(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.fenced(&self.sql.mark_unknown, id, epoch).await
    }

    async fn renew(
        &self,
        id: &OperationId,
        epoch: u64,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        let Some(epoch) = sql_epoch(epoch) else {
            return Ok(Fence::Lost);
        };
        let done = sqlx::query(&self.sql.renew)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(millis(lease))
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(fence(done.rows_affected()))
    }

    async fn resolve(
        &self,
        id: &OperationId,
        epoch: u64,
        completed: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        match completed {
            None => self.fenced(&self.sql.resolve_delete, id, epoch).await,
            Some((outcome, retain)) => {
                self.write_outcome(&self.sql.resolve_record, id, epoch, outcome, retain)
                    .await
            }
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let done = sqlx::query(&self.sql.purge)
                .bind(PURGE_BATCH)
                .execute(&self.pool)
                .await
                .map_err(map_err)?;
            total += done.rows_affected();
            if done.rows_affected() < PURGE_BATCH.unsigned_abs() {
                return Ok(total);
            }
        }
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let rows = sqlx::query(&self.sql.stats)
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        let mut stats = Stats::default();
        for row in rows {
            let code: i64 = row.try_get("state").map_err(map_err)?;
            let n: i64 = row.try_get("n").map_err(map_err)?;
            let oldest: i64 = row.try_get("oldest_ms").map_err(map_err)?;
            let n = u64::try_from(n).unwrap_or(0);
            match State::from_code(code) {
                Some(State::InProgress) => {
                    stats.in_progress = n;
                    stats.oldest_in_progress = Some(duration_ms(oldest));
                }
                Some(State::Completed) => stats.completed = n,
                Some(State::Unknown) => {
                    stats.unknown = n;
                    stats.oldest_unknown = Some(duration_ms(oldest));
                }
                None => return Err(corrupt(format!("unknown state code {code}"))),
            }
        }
        Ok(stats)
    }

    async fn get(&self, id: &OperationId) -> Result<Option<RecordDetail>, StoreError> {
        let row = sqlx::query(&self.sql.get)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .fetch_optional(&self.pool)
            .await
            .map_err(map_err)?;
        let Some(row) = row else { return Ok(None) };
        let get = |c: &str| row.try_get::<Option<i64>, _>(c).map_err(map_err);
        sql_common::record_detail(
            id,
            get("state")?.unwrap_or(-1),
            get("epoch")?.unwrap_or(-1),
            get("age_ms")?.unwrap_or(0),
            get("lease_ms")?,
            get("expires_ms")?,
            row.try_get("outcome").map_err(map_err)?,
            get("outcome_is_err")?.unwrap_or(0) != 0,
            get("outcome_version")?.unwrap_or(0),
        )
        .map(Some)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let rows = sqlx::query(&self.sql.list)
            .bind(filter.state.map(|s| i64::from(s.code())))
            .bind(filter.name.as_deref())
            .bind(filter.older_than.map(millis))
            .bind(i64::from(filter.limit()))
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.iter()
            .map(|row| {
                let code: i64 = row.try_get("state").map_err(map_err)?;
                Ok(RecordInfo {
                    id: OperationId {
                        scope: row.try_get("scope").map_err(map_err)?,
                        name: row.try_get("name").map_err(map_err)?,
                        key: row.try_get("key").map_err(map_err)?,
                    },
                    state: State::from_code(code)
                        .ok_or_else(|| corrupt(format!("unknown state code {code}")))?,
                    epoch: epoch_from_sql(row.try_get("epoch").map_err(map_err)?)?,
                    age: duration_ms(row.try_get("age_ms").map_err(map_err)?),
                })
            })
            .collect()
    }
}

/// Transactional mode: claims `id` inside the caller's transaction on `conn`.
///
/// SQLite has no row locks: a concurrent duplicate waits on the database write lock (the
/// caller should `BEGIN IMMEDIATE`), so by the time this runs the other transaction has
/// committed or rolled back.
pub(crate) async fn tx_claim_sqlite(
    conn: &mut SqliteConnection,
    store: &SqliteStore,
    id: &OperationId,
    fingerprint: &[u8; 32],
    lease: Duration,
) -> Result<TxClaim, StoreError> {
    sql_common::tx_claim(&mut TxConn {
        conn,
        sql: &store.sql,
        id,
        fingerprint,
        lease: millis(lease),
    })
    .await
}

/// One transactional claim's statements on the caller's connection.
struct TxConn<'a> {
    conn: &'a mut SqliteConnection,
    sql: &'a Statements,
    id: &'a OperationId,
    fingerprint: &'a [u8; 32],
    lease: i64,
}

impl TxConn<'_> {
    /// One statement over (scope, name, key, fingerprint), and the lease if it takes one.
    async fn step(&mut self, sql: &str, lease: bool) -> Result<Option<SqliteRow>, StoreError> {
        let mut query = sqlx::query(sql)
            .bind(&self.id.scope)
            .bind(&self.id.name)
            .bind(&self.id.key)
            .bind(&self.fingerprint[..]);
        if lease {
            query = query.bind(self.lease);
        }
        query.fetch_optional(&mut *self.conn).await.map_err(map_err)
    }

    /// A claiming statement: the epoch it returned, if it claimed.
    async fn claiming(&mut self, sql: &str) -> Result<Option<i64>, StoreError> {
        match self.step(sql, true).await? {
            Some(row) => row.try_get("epoch").map(Some).map_err(map_err),
            None => Ok(None),
        }
    }
}

impl sql_common::TxSteps for TxConn<'_> {
    async fn insert(&mut self) -> Result<Option<i64>, StoreError> {
        let sql = self.sql;
        self.claiming(&sql.tx_claim).await
    }

    async fn read(&mut self) -> Result<Option<TxRow>, StoreError> {
        let sql = self.sql;
        let Some(row) = self.step(&sql.tx_read, false).await? else {
            return Ok(None);
        };
        let read = || -> Result<TxRow, sqlx::Error> {
            Ok(TxRow {
                same_fingerprint: row.try_get("same_fingerprint")?,
                expired: row.try_get("expired")?,
                lapsed: row.try_get("lapsed")?,
                state: row.try_get("state")?,
                epoch: row.try_get("epoch")?,
                retry_after_ms: row.try_get("retry_after_ms")?,
                outcome: row.try_get("outcome")?,
                outcome_is_err: row.try_get("outcome_is_err")?,
                outcome_version: row.try_get("outcome_version")?,
            })
        };
        read().map(Some).map_err(map_err)
    }

    async fn reclaim_expired(&mut self) -> Result<Option<i64>, StoreError> {
        let sql = self.sql;
        self.claiming(&sql.tx_reclaim).await
    }

    async fn take_over(&mut self) -> Result<Option<i64>, StoreError> {
        let sql = self.sql;
        self.claiming(&sql.tx_takeover).await
    }
}

/// Transactional mode: records the outcome of the claim this transaction holds on `id`.
pub(crate) async fn tx_record_sqlite(
    conn: &mut SqliteConnection,
    store: &SqliteStore,
    id: &OperationId,
    outcome: &StoredOutcome,
    retain: Duration,
) -> Result<Fence, StoreError> {
    let done = sqlx::query(&store.sql.tx_record)
        .bind(&id.scope)
        .bind(&id.name)
        .bind(&id.key)
        .bind(&outcome.body)
        .bind(outcome.is_err)
        .bind(i64::from(outcome.version))
        .bind(millis(retain))
        .execute(conn)
        .await
        .map_err(map_err)?;
    Ok(fence(done.rows_affected()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const FP: [u8; 32] = [1; 32];
    const OTHER_FP: [u8; 32] = [2; 32];
    const LEASE: Duration = Duration::from_secs(60);
    /// Comfortably past [`TINY_LEASE`] (and a tiny retention) by the store's clock.
    const PAST_TINY: Duration = Duration::from_millis(40);
    const DAY: Duration = Duration::from_secs(86_400);

    async fn memory() -> SqliteStore {
        open("sqlite::memory:", &SqlOptions::default())
            .await
            .expect("open in-memory store")
    }

    fn op(key: &str) -> OperationId {
        OperationId {
            scope: "tenant".into(),
            name: "charge".into(),
            key: key.into(),
        }
    }

    fn req<'a>(id: &'a OperationId, fingerprint: [u8; 32], lease: Duration) -> ClaimRequest<'a> {
        ClaimRequest {
            id,
            fingerprint,
            lease,
            on_takeover: Takeover::Rerun,
        }
    }

    fn outcome(body: &str) -> StoredOutcome {
        StoredOutcome {
            is_err: false,
            version: 1,
            body: body.as_bytes().to_vec(),
        }
    }

    async fn claim(store: &SqliteStore, id: &OperationId, fp: [u8; 32], lease: Duration) -> Claim {
        store.claim(&req(id, fp, lease)).await.expect("claim")
    }

    fn epoch_of(claim: Claim) -> u64 {
        match claim {
            Claim::Acquired { epoch, .. } => epoch,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn conformance_in_memory_and_in_a_file() {
        crate::store::conformance::run_all(&memory().await).await;
        let db = TempDb::new("conformance");
        let store = open(db.0.to_str().unwrap(), &SqlOptions::default())
            .await
            .unwrap();
        crate::store::conformance::run_all(&store).await;
    }

    #[tokio::test]
    async fn table_names_are_validated_and_used() {
        let bad = SqlOptions {
            table: "idem ops".into(),
            migrate: true,
            ..SqlOptions::default()
        };
        assert!(matches!(
            open("sqlite::memory:", &bad).await,
            Err(IdemError::Config { .. })
        ));
        let missing = SqlOptions {
            table: "not_created".into(),
            migrate: false,
            ..SqlOptions::default()
        };
        match open("sqlite::memory:", &missing).await {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("SQLITE_SCHEMA_SQL"), "{message}")
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
        let custom = SqlOptions {
            table: "order".into(),
            migrate: true,
            ..SqlOptions::default()
        };
        let store = open("sqlite::memory:", &custom).await.unwrap();
        let id = op("o-8");
        assert_eq!(
            claim(&store, &id, FP, LEASE).await,
            Claim::Acquired {
                epoch: 1,
                takeover: false
            }
        );
    }

    #[tokio::test]
    async fn shipped_schema_works_without_migrate() {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::raw_sql(sql_common::SQLITE_SCHEMA_SQL)
            .execute(&pool)
            .await
            .unwrap();
        let opts = SqlOptions {
            migrate: false,
            ..SqlOptions::default()
        };
        let store = from_pool(pool, &opts).await.unwrap();
        let id = op("o-9");
        assert_eq!(
            claim(&store, &id, FP, LEASE).await,
            Claim::Acquired {
                epoch: 1,
                takeover: false
            }
        );
    }

    /// A database file in the system temp dir, removed (with its WAL files) on drop.
    struct TempDb(std::path::PathBuf);

    impl TempDb {
        fn new(name: &str) -> TempDb {
            let path = std::env::temp_dir().join(format!("idem-{name}-{}.db", std::process::id()));
            let db = TempDb(path);
            db.remove();
            db
        }

        fn remove(&self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut p = self.0.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        }
    }

    impl Drop for TempDb {
        fn drop(&mut self) {
            self.remove();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn file_database_concurrent_claims_run_once() {
        let db = TempDb::new("concurrent");
        let path = db.0.to_str().unwrap().to_owned();
        // Several stores open the same new file at once, as several processes would.
        let opens = (0..4).map(|i| {
            let url = if i % 2 == 0 {
                format!("sqlite://{path}")
            } else {
                path.clone()
            };
            tokio::spawn(async move { open(&url, &SqlOptions::default()).await })
        });
        let mut stores = Vec::new();
        for handle in opens {
            stores.push(Arc::new(handle.await.unwrap().expect("concurrent open")));
        }
        let id = Arc::new(op("hot"));
        let barrier = Arc::new(tokio::sync::Barrier::new(50));
        let tasks: Vec<_> = (0..50)
            .map(|i| {
                let (store, id, barrier) = (
                    stores[i % stores.len()].clone(),
                    id.clone(),
                    barrier.clone(),
                );
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.claim(&req(&id, FP, LEASE)).await
                })
            })
            .collect();
        let mut acquired = 0;
        for task in tasks {
            match task.await.unwrap().expect("claim under contention") {
                Claim::Acquired {
                    epoch: 1,
                    takeover: false,
                } => acquired += 1,
                Claim::InFlight { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(acquired, 1);
        // The file persists across stores.
        drop(stores);
        let again = open(&path, &SqlOptions::default()).await.unwrap();
        assert!(matches!(
            claim(&again, &id, FP, LEASE).await,
            Claim::InFlight { .. }
        ));
    }

    #[tokio::test]
    async fn transactional_claim_and_record() {
        // Spawned, so the helpers' futures are checked to be `Send` for any lifetime.
        let store = memory().await;
        tokio::spawn(async move { transactional(store).await })
            .await
            .unwrap();
    }

    async fn transactional(store: SqliteStore) {
        let id = op("tx-1");
        let mut tx = store.pool.begin().await.unwrap();
        assert!(matches!(
            tx_claim_sqlite(&mut tx, &store, &id, &FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Acquired { .. }
        ));
        // The same transaction claiming twice sees its own claim.
        assert!(matches!(
            tx_claim_sqlite(&mut tx, &store, &id, &FP, LEASE)
                .await
                .unwrap(),
            TxClaim::InFlight { .. }
        ));
        let done = outcome("\"tx\"");
        assert_eq!(
            tx_record_sqlite(&mut tx, &store, &id, &done, DAY)
                .await
                .unwrap(),
            Fence::Held
        );
        tx.commit().await.unwrap();

        let mut tx = store.pool.begin().await.unwrap();
        assert_eq!(
            tx_claim_sqlite(&mut tx, &store, &id, &FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Completed(done)
        );
        assert_eq!(
            tx_claim_sqlite(&mut tx, &store, &id, &OTHER_FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Mismatch
        );
        tx.rollback().await.unwrap();

        // Rollback is the release.
        let rolled = op("tx-2");
        let mut tx = store.pool.begin().await.unwrap();
        tx_claim_sqlite(&mut tx, &store, &rolled, &FP, LEASE)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        let mut tx = store.pool.begin().await.unwrap();
        assert!(matches!(
            tx_claim_sqlite(&mut tx, &store, &rolled, &OTHER_FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Acquired { .. }
        ));
        tx.rollback().await.unwrap();

        // An expired record is absent in transactional mode too.
        let expired = op("tx-3");
        let epoch = epoch_of(claim(&store, &expired, FP, LEASE).await);
        store
            .record(&expired, epoch, &outcome("old"), Duration::from_millis(1))
            .await
            .unwrap();
        tokio::time::sleep(PAST_TINY).await;
        let mut tx = store.pool.begin().await.unwrap();
        assert!(matches!(
            tx_claim_sqlite(&mut tx, &store, &expired, &OTHER_FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Acquired { .. }
        ));
        tx.commit().await.unwrap();

        let unknown = op("tx-4");
        let epoch = epoch_of(claim(&store, &unknown, FP, LEASE).await);
        store.mark_unknown(&unknown, epoch).await.unwrap();
        let mut tx = store.pool.begin().await.unwrap();
        assert_eq!(
            tx_claim_sqlite(&mut tx, &store, &unknown, &FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Unknown { epoch }
        );
    }

    #[tokio::test]
    async fn unopenable_path_says_what_to_check() {
        let url = "/nonexistent-idem-dir/sub/idem.db";
        match open(url, &SqlOptions::default()).await {
            Err(IdemError::Config { message }) => {
                assert!(
                    message.contains(url) && message.contains("writable"),
                    "{message}"
                );
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
    }

    #[test]
    fn memory_urls_are_recognised() {
        for url in [
            "sqlite::memory:",
            "sqlite://:memory:",
            ":memory:",
            "sqlite://x?mode=memory",
        ] {
            assert!(is_memory(url), "{url}");
        }
        for url in ["sqlite://data.db", "data.db", "sqlite:memory.db?mode=rwc"] {
            assert!(!is_memory(url), "{url}");
        }
    }

    #[test]
    fn tokens_do_not_repeat() {
        let tokens: std::collections::HashSet<i64> = (0..10_000).map(|_| claim_token()).collect();
        assert_eq!(tokens.len(), 10_000);
    }

    #[test]
    fn busy_and_locked_are_retryable() {
        assert!(retryable_code("5") && retryable_code("517") && retryable_code("6"));
        assert!(!retryable_code("19") && !retryable_code("2067") && !retryable_code("1"));
    }
}
