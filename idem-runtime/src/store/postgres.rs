//! The production store: one PostgreSQL table, leases by the database's clock.
//!
//! Every method is one statement (the claim re-issues itself in one rare race, below).
//! Times are `clock_timestamp()`, the wall clock at the moment of evaluation; `now()`
//! would be the start of the transaction, which in a caller's long transaction is old.
//! Callers waiting in other processes are woken through `LISTEN`/`NOTIFY`.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Executor, Row};

use super::sql_common::{
    self, ClaimRow, Decision, SqlOptions, TableName, TxClaim, TxRow, corrupt, decide, duration_ms,
    epoch_from_sql, millis, redact_url, sql_epoch, sql_version,
};
use super::{
    Claim, ClaimRequest, Fence, ListFilter, OperationId, RecordDetail, RecordInfo, State, Stats,
    Store, StoredOutcome, Takeover,
};
use crate::error::{IdemError, StoreError};
use crate::wake::WakeHub;

use sql_common::POSTGRES_MIGRATIONS as MIGRATIONS;

/// The epoch a claim takes: from the table's sequence, so no epoch ever repeats.
const NEXT_EPOCH: &str = "nextval('{epoch_seq}')";

/// The advisory lock that serializes idem's migrations across processes ("idemmigr").
const MIGRATION_LOCK: i64 = 0x6964_656d_6d69_6772;

/// The channel on which record/release/mark_unknown/resolve announce that an operation
/// moved on, when someone waits on it. The payload is the JSON of its [`OperationId`].
const WAKE_CHANNEL: &str = "idem_wake";

/// Connections `Idem::postgres` holds for claims and records, unless the builder says
/// otherwise.
const DEFAULT_MAX_CONNECTIONS: u32 = 16;

/// Connections of the sqlx pool beside idem's own, for everything but claims and records.
const ADMIN_CONNECTIONS: u32 = 4;

/// A connection idle for longer than this is pinged before use. Short enough that a
/// server restart is caught before a statement fails on a dead connection (restarts
/// take longer than this), long enough that a busy connection is never pinged.
const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// How often the claim statement is issued before giving up on the snapshot race.
const CLAIM_ATTEMPTS: usize = 5;

/// Records purged per statement, so a large purge does not lock many rows at once.
const PURGE_BATCH: i64 = 1000;

const LOCK_MIGRATIONS: &str = "SELECT pg_advisory_xact_lock($1)";

/// idem's own migration bookkeeping, in the table's schema, one row per (table, version);
/// never sqlx's `_sqlx_migrations`, which belongs to the application.
const BOOKKEEPING_DDL: &str = "CREATE TABLE IF NOT EXISTS {bookkeeping} (
    table_name TEXT        NOT NULL,
    version    INTEGER     NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (table_name, version)
)";

/// ?1 the schema (NULL: the one new tables go to), ?2 the table.
const TABLE_EXISTS: &str = "SELECT 1 FROM information_schema.tables
    WHERE table_schema = COALESCE($1::text, current_schema()) AND table_name = $2";

const FORGET_MIGRATIONS: &str = "DELETE FROM {bookkeeping} WHERE table_name = $1";

const APPLIED_MIGRATIONS: &str = "SELECT version FROM {bookkeeping} WHERE table_name = $1";

const RECORD_MIGRATION: &str = "INSERT INTO {bookkeeping} (table_name, version) VALUES ($1, $2)";

/// Reads every column idem uses, so a missing or foreign table fails at open, not at the
/// first claim.
const PROBE: &str = "SELECT scope, name, key, state, epoch, fingerprint, taken_over, lease_until,
    created_at, claimed_at, expires_at, outcome, outcome_is_err, outcome_version, waiters,
    (SELECT key_mode FROM {meta} WHERE id = 0) AS key_mode,
    (SELECT last_value FROM {epoch_seq}) AS last_epoch
    FROM {table} LIMIT 0";

const SET_KEY_MODE: &str = "UPDATE {meta} SET key_mode = $1 WHERE id = 0 AND key_mode IS NULL";
const GET_KEY_MODE: &str = "SELECT key_mode FROM {meta} WHERE id = 0";

/// The record is COMPLETED and its retention has passed: it counts as absent, so the
/// claim starts afresh (new fingerprint, a new epoch so stale writers stay fenced).
const EXPIRED: &str = "(cur.state = 1 AND cur.expires_at <= EXCLUDED.claimed_at)";

/// The record is IN_PROGRESS, its lease has lapsed, and it is the same request: another
/// caller may take it over. A different request never takes over (that is a mismatch).
const LAPSED: &str = "(cur.state = 0 AND cur.lease_until <= EXCLUDED.claimed_at \
                      AND cur.fingerprint = EXCLUDED.fingerprint)";

/// The claim: one statement, one round trip, for fresh claims and replays alike.
///
/// Parameters: $1 scope, $2 name, $3 key, $4 fingerprint, $5 lease (ms), $6 whether a
/// lapsed lease goes to UNKNOWN.
///
/// `seen` reads the row in the statement's snapshot. When it shows a row that cannot be
/// claimed (COMPLETED and unexpired, a live IN_PROGRESS, UNKNOWN, another fingerprint),
/// `ins` inserts nothing, so a replay neither locks nor writes the row: it costs one
/// primary-key read. Otherwise `ins` inserts a fresh claim (the sequence's next epoch), or on conflict
/// updates the row only when it is claimable (`WHERE {expired} OR {lapsed}`, judged on
/// the latest committed version, which `ON CONFLICT` locks):
///
/// | old row                      | $6    | new row                          |
/// |------------------------------|-------|----------------------------------|
/// | COMPLETED, expired           | —     | fresh claim, next epoch, new fp  |
/// | IN_PROGRESS, lapsed, same fp | false | takeover: next epoch, new lease  |
/// | IN_PROGRESS, lapsed, same fp | true  | UNKNOWN, same epoch              |
/// | anything else                | —     | not updated: `ins` is empty      |
///
/// `EXCLUDED.claimed_at` is the statement's `now`. When `ins` returns a row it is ours
/// (`mine`). Otherwise the row `seen` is returned, for [`decide`] to tell replay,
/// in-flight, mismatch and UNKNOWN apart. Skipping the insert on what the snapshot shows
/// is safe: a COMPLETED outcome is immutable until it expires, and the other
/// unclaimable states are answered as a read would answer them a moment earlier.
///
/// Under READ COMMITTED, when the conflicting row was committed after the statement
/// began (a concurrent first claim), the snapshot does not have it and the statement
/// returns no row; or it has an older version that looks claimable (`stale`). Both mean
/// "issue the statement again", which then sees the committed row.
const CLAIM: &str = "WITH seen AS (
    SELECT state, epoch, fingerprint, taken_over, lease_until, expires_at, outcome,
        outcome_is_err, outcome_version, clock_timestamp() AS now
    FROM {table}
    WHERE scope = $1 AND name = $2 AND key = $3
), ins AS (
    INSERT INTO {table} AS cur (scope, name, key, state, epoch, fingerprint, taken_over,
        lease_until, created_at, claimed_at, expires_at, outcome, outcome_is_err,
        outcome_version, waiters)
    SELECT $1, $2, $3, 0, {next_epoch}, $4, false, n.now + $5::bigint * interval '1 millisecond',
        n.now, n.now, NULL, NULL, false, 0, false
    FROM (SELECT clock_timestamp() AS now) AS n
    WHERE NOT EXISTS (
        SELECT 1 FROM seen
        WHERE NOT ((state = 0 AND lease_until <= now AND fingerprint = $4)
                   OR (state = 1 AND expires_at <= now)))
    ON CONFLICT (scope, name, key) DO UPDATE SET
        state = CASE WHEN {expired} OR NOT $6 THEN 0 ELSE 2 END,
        epoch = CASE WHEN {expired} OR NOT $6 THEN EXCLUDED.epoch ELSE cur.epoch END,
        fingerprint = EXCLUDED.fingerprint,
        taken_over = CASE WHEN {expired} THEN false WHEN $6 THEN cur.taken_over ELSE true END,
        lease_until = CASE WHEN {expired} OR NOT $6 THEN EXCLUDED.lease_until
                           ELSE cur.lease_until END,
        created_at = CASE WHEN {expired} THEN EXCLUDED.created_at ELSE cur.created_at END,
        claimed_at = CASE WHEN {expired} OR NOT $6 THEN EXCLUDED.claimed_at
                          ELSE cur.claimed_at END,
        expires_at = NULL,
        outcome = NULL,
        outcome_is_err = false,
        outcome_version = 0,
        waiters = CASE WHEN {expired} THEN false ELSE cur.waiters END
    WHERE {expired} OR {lapsed}
    RETURNING true AS mine, false AS stale, cur.state, cur.epoch,
        true AS same_fingerprint, cur.taken_over, 0::bigint AS retry_after_ms, cur.outcome,
        cur.outcome_is_err, cur.outcome_version
)
SELECT mine, stale, state, epoch, same_fingerprint, taken_over, retry_after_ms, outcome,
    outcome_is_err, outcome_version
FROM ins
UNION ALL
SELECT false, (state = 0 AND lease_until <= now AND fingerprint = $4)
        OR (state = 1 AND expires_at <= now),
    state, epoch, fingerprint = $4, taken_over,
    greatest(0, (EXTRACT(EPOCH FROM lease_until - now) * 1000)::bigint),
    CASE WHEN fingerprint = $4 THEN outcome END, outcome_is_err, outcome_version
FROM seen
WHERE NOT EXISTS (SELECT 1 FROM ins)";

/// The fenced writes that end a claim share one shape: the change in `upd`, then a
/// `NOTIFY` in the same statement when a caller announced it waits (`waiters`). `held`
/// is the fence, `woke` whether a notification was sent (selecting from `woke` is also
/// what makes PostgreSQL run it: an unreferenced read-only CTE is skipped). $1..$3 the
/// operation, $4 the epoch, $5 the notification payload.
///
/// Record: $6 outcome, $7 is_err, $8 version, $9 retain (ms).
///
/// The same outcome already recorded at the same epoch also holds: that is this record
/// retried after its first attempt committed but its reply was lost.
const RECORD: &str = "WITH upd AS (
    UPDATE {table}
    SET state = 1, outcome = $6, outcome_is_err = $7, outcome_version = $8,
        expires_at = CASE WHEN state = 0
                          THEN clock_timestamp() + $9::bigint * interval '1 millisecond'
                          ELSE expires_at END
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4
      AND (state = 0 OR (state = 1 AND outcome = $6 AND outcome_is_err = $7
                         AND outcome_version = $8))
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', $5) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke";

const RELEASE: &str = "WITH upd AS (
    DELETE FROM {table}
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4 AND state = 0
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', $5) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke";

const MARK_UNKNOWN: &str = "WITH upd AS (
    UPDATE {table} SET state = 2
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4 AND state = 0
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', $5) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke";

/// Parameters as [`RECORD`]; also settles an UNKNOWN record.
const RESOLVE_RECORD: &str = "WITH upd AS (
    UPDATE {table}
    SET state = 1, outcome = $6, outcome_is_err = $7, outcome_version = $8,
        expires_at = clock_timestamp() + $9::bigint * interval '1 millisecond'
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4 AND state IN (0, 2)
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', $5) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke";

const RESOLVE_DELETE: &str = "WITH upd AS (
    DELETE FROM {table}
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4 AND state IN (0, 2)
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', $5) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke";

/// $1..$3 the operation, $4 the epoch, $5 the new lease (ms).
const RENEW: &str = "UPDATE {table}
    SET lease_until = clock_timestamp() + $5::bigint * interval '1 millisecond'
    WHERE scope = $1 AND name = $2 AND key = $3 AND epoch = $4 AND state = 0";

/// A caller is about to wait on this claim: later writes that end it will `NOTIFY`.
const ANNOUNCE_WAIT: &str = "UPDATE {table} SET waiters = true
    WHERE scope = $1 AND name = $2 AND key = $3 AND state = 0 AND NOT waiters";

/// $1 the batch size. `SKIP LOCKED` leaves rows a claim is reclaiming right now alone;
/// the outer condition is re-checked on the locked rows.
const PURGE: &str = "DELETE FROM {table}
    WHERE (scope, name, key) IN (
        SELECT scope, name, key FROM {table}
        WHERE state = 1 AND expires_at <= clock_timestamp()
        LIMIT $1 FOR UPDATE SKIP LOCKED)
      AND state = 1 AND expires_at <= clock_timestamp()";

const STATS: &str = "SELECT state, count(*) AS n,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - min(claimed_at)) * 1000)::bigint)
            AS oldest_ms
    FROM {table} GROUP BY state";

/// $1 state or NULL, $2 name or NULL, $3 minimum age (ms) or NULL, $4 limit.
const LIST: &str = "SELECT scope, name, key, state, epoch,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - claimed_at) * 1000)::bigint)
            AS age_ms
    FROM {table}
    WHERE ($1::smallint IS NULL OR state = $1)
      AND ($2::text IS NULL OR name = $2)
      AND ($3::bigint IS NULL
           OR claimed_at <= clock_timestamp() - $3::bigint * interval '1 millisecond')
    ORDER BY claimed_at, scope, name, key
    LIMIT $4";

/// One record in full. $1..$3 the operation.
const GET: &str = "SELECT state, epoch,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - claimed_at) * 1000)::bigint)
            AS age_ms,
        greatest(0, (EXTRACT(EPOCH FROM lease_until - clock_timestamp()) * 1000)::bigint)
            AS lease_ms,
        greatest(0, (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000)::bigint)
            AS expires_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = $1 AND name = $2 AND key = $3";

/// Transactional mode: the claim inside the caller's transaction. The row lock is the
/// claim; a concurrent duplicate blocks here until the first transaction ends. The lease
/// only matters if the caller commits without finishing (a cancelled body): the claim
/// then lapses like a leased one. $1..$3 the operation, $4 the fingerprint, $5 the lease
/// (ms).
const TX_CLAIM: &str = "INSERT INTO {table} (scope, name, key, state, epoch, fingerprint,
        taken_over, lease_until, created_at, claimed_at)
    SELECT $1, $2, $3, 0, {next_epoch}, $4, false,
        n.now + $5::bigint * interval '1 millisecond', n.now, n.now
    FROM (SELECT clock_timestamp() AS now) AS n
    ON CONFLICT (scope, name, key) DO NOTHING
    RETURNING epoch";

/// Transactional mode: the row that made [`TX_CLAIM`] do nothing. A new statement, so
/// under READ COMMITTED it sees the row the other transaction committed.
const TX_READ: &str = "SELECT state, epoch, fingerprint = $4 AS same_fingerprint,
        COALESCE(state = 1 AND expires_at <= clock_timestamp(), false) AS expired,
        (state = 0 AND lease_until <= clock_timestamp()) AS lapsed,
        greatest(0, (EXTRACT(EPOCH FROM lease_until - clock_timestamp()) * 1000)::bigint)
            AS retry_after_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = $1 AND name = $2 AND key = $3";

/// Transactional mode: an expired COMPLETED record counts as absent; claim it afresh.
const TX_RECLAIM_EXPIRED: &str = "UPDATE {table}
    SET state = 0, epoch = {next_epoch}, fingerprint = $4, taken_over = false,
        lease_until = clock_timestamp() + $5::bigint * interval '1 millisecond',
        created_at = clock_timestamp(),
        claimed_at = clock_timestamp(), expires_at = NULL, outcome = NULL,
        outcome_is_err = false, outcome_version = 0, waiters = false
    WHERE scope = $1 AND name = $2 AND key = $3 AND state = 1
      AND expires_at <= clock_timestamp()
    RETURNING epoch";

/// Transactional mode: a lapsed claim of the same request is taken over, as a leased
/// claim would be. $5 the lease (ms).
const TX_TAKEOVER: &str = "UPDATE {table}
    SET epoch = {next_epoch}, taken_over = true,
        lease_until = clock_timestamp() + $5::bigint * interval '1 millisecond',
        claimed_at = clock_timestamp()
    WHERE scope = $1 AND name = $2 AND key = $3 AND state = 0
      AND lease_until <= clock_timestamp() AND fingerprint = $4
    RETURNING epoch";

/// Transactional mode: $4 outcome, $5 is_err, $6 version, $7 retain (ms).
const TX_RECORD: &str = "UPDATE {table}
    SET state = 1, outcome = $4, outcome_is_err = $5, outcome_version = $6,
        expires_at = clock_timestamp() + $7::bigint * interval '1 millisecond'
    WHERE scope = $1 AND name = $2 AND key = $3 AND state = 0";

/// Every statement, rendered once for the configured table.
#[derive(Debug)]
struct Statements {
    claim: String,
    record: String,
    release: String,
    mark_unknown: String,
    renew: String,
    resolve_record: String,
    resolve_delete: String,
    announce_wait: String,
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
        let r = |sql: &str| {
            table.render(
                &sql.replace("{next_epoch}", NEXT_EPOCH),
                "clock_timestamp()",
            )
        };
        let claim = CLAIM
            .replace("{lapsed}", LAPSED)
            .replace("{expired}", EXPIRED);
        Statements {
            claim: r(&claim),
            record: r(RECORD),
            release: r(RELEASE),
            mark_unknown: r(MARK_UNKNOWN),
            renew: r(RENEW),
            resolve_record: r(RESOLVE_RECORD),
            resolve_delete: r(RESOLVE_DELETE),
            announce_wait: r(ANNOUNCE_WAIT),
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

/// Aborts the wake listener when the store goes away.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Connections idem holds for its hot statements, outside sqlx's pool.
///
/// sqlx's pool pings every connection when it is returned (to catch one a cancelled
/// query left mid-protocol), one more round trip per statement than the statement
/// itself. Here a connection goes back only when its statement finished; one whose
/// statement was cancelled or failed on the wire is dropped (closed) instead, which
/// gives the same safety without the round trip.
#[derive(Debug)]
struct Conns {
    options: PgConnectOptions,
    permits: tokio::sync::Semaphore,
    idle: Mutex<Vec<(PgConnection, std::time::Instant)>>,
}

impl Conns {
    fn new(options: PgConnectOptions, max: u32) -> Conns {
        Conns {
            options,
            permits: tokio::sync::Semaphore::new(max.max(1) as usize),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `query` on an idle connection (or a new one) and returns the connection
    /// only if the statement completed.
    async fn fetch_optional(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let mut conn = self.take().await?;
        let out = query.fetch_optional(&mut conn).await;
        // A statement error leaves the connection ready for the next statement; an I/O
        // or protocol error, or the server ending the session (SQLSTATE classes 08 and
        // 57, as in a shutdown or `pg_terminate_backend`), does not.
        let reusable = match &out {
            Ok(_) => true,
            Err(sqlx::Error::Database(e)) => !e
                .code()
                .is_some_and(|c| c.starts_with("08") || c.starts_with("57")),
            Err(_) => false,
        };
        if reusable {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.push((conn, std::time::Instant::now()));
        }
        out
    }

    async fn take(&self) -> Result<PgConnection, sqlx::Error> {
        loop {
            let next = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let Some((mut conn, since)) = next else {
                return sqlx::Connection::connect_with(&self.options).await;
            };
            if since.elapsed() <= IDLE_BEFORE_PING
                || sqlx::Connection::ping(&mut conn).await.is_ok()
            {
                return Ok(conn);
            }
        }
    }
}

/// The PostgreSQL [`Store`]: a pool, the statements for its table, and (once wakers are
/// attached) a background `LISTEN` task that stops with the store.
#[derive(Debug)]
pub(crate) struct PgStore {
    pool: PgPool,
    /// The claim's and the record's connections, when idem opened the database itself.
    owned: Option<Conns>,
    sql: Statements,
    listener: Mutex<Option<AbortOnDrop>>,
}

/// Connects to `url` and opens the idem table there, creating it unless `opts.migrate`
/// is false.
pub(crate) async fn open(url: &str, opts: &SqlOptions) -> Result<PgStore, IdemError> {
    let table = TableName::parse(&opts.table, true)?;
    let shown = redact_url(url);
    let connect = PgConnectOptions::from_str(url).map_err(|e| IdemError::Config {
        message: format!(
            "invalid PostgreSQL URL `{shown}`: {e}; expected `postgres://user:password@host:port/database`"
        ),
    })?;
    // The claim and the record run on idem's own connections (`Conns`); this pool
    // serves migrations, renewals and the operations queries. sqlx pings every
    // connection it hands out, one extra round trip per statement; ping only those that
    // sat idle long enough to have been dropped by a proxy or a server restart.
    let pool = PgPoolOptions::new()
        .max_connections(ADMIN_CONNECTIONS)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > IDLE_BEFORE_PING {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .connect_with(connect)
        .await
        .map_err(|e| {
            let e = map_err(e);
            IdemError::store(
                "connecting to PostgreSQL",
                StoreError::new(
                    e.retryable,
                    format!(
                        "cannot connect to PostgreSQL at `{shown}`: {}; check the server is up \
                         and the URL's host, port, user and database",
                        e.source
                    ),
                ),
            )
        })?;
    let owned = Conns::new(
        (*pool.connect_options()).clone(),
        opts.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
    );
    prepare(pool, Some(owned), table, opts).await
}

/// Uses an application's pool; creates the idem table unless `opts.migrate` is false.
pub(crate) async fn from_pool(pool: PgPool, opts: &SqlOptions) -> Result<PgStore, IdemError> {
    let table = TableName::parse(&opts.table, true)?;
    prepare(pool, None, table, opts).await
}

async fn prepare(
    pool: PgPool,
    owned: Option<Conns>,
    table: TableName,
    opts: &SqlOptions,
) -> Result<PgStore, IdemError> {
    if opts.migrate {
        run_migrations(&pool, &table).await.map_err(|e| {
            open_error(
                e,
                format!(
                    "cannot create the idem table `{table}`; grant CREATE on its schema, or \
                     create it yourself with `POSTGRES_SCHEMA_SQL` and disable migrate"
                ),
            )
        })?;
    }
    let probe = table.render(PROBE, "clock_timestamp()");
    sqlx::query(&probe).execute(&pool).await.map_err(|e| {
        open_error(
            e,
            format!(
                "the idem table `{table}` is missing or lacks idem's columns; create it with \
                 `POSTGRES_SCHEMA_SQL` (renamed to `{table}`) or enable migrate"
            ),
        )
    })?;
    let set = table.render(SET_KEY_MODE, "clock_timestamp()");
    let get = table.render(GET_KEY_MODE, "clock_timestamp()");
    let recorded = async {
        sqlx::query(&set)
            .bind(&opts.key_mode)
            .execute(&pool)
            .await?;
        sqlx::query_scalar::<_, Option<String>>(&get)
            .fetch_one(&pool)
            .await
    }
    .await
    .map_err(|e| open_error(e, format!("cannot read the key mode of `{table}`")))?;
    sql_common::check_key_mode(&table, recorded, &opts.key_mode)?;
    let sql = Statements::new(&table);
    Ok(PgStore {
        pool,
        owned,
        sql,
        listener: Mutex::new(None),
    })
}

/// Applies the missing migrations in one transaction under an advisory lock, so
/// processes opening at once apply them one after another and the later ones find
/// nothing left to do (even `CREATE ... IF NOT EXISTS` can fail on a concurrent create).
async fn run_migrations(pool: &PgPool, table: &TableName) -> Result<(), sqlx::Error> {
    let bookkeeping =
        |sql: &str| sql.replace("{bookkeeping}", &table.sibling("idem_schema_migrations"));
    let mut tx = pool.begin().await?;
    sqlx::query(LOCK_MIGRATIONS)
        .bind(MIGRATION_LOCK)
        .execute(&mut *tx)
        .await?;
    if let Some(schema) = table.schema() {
        let create = format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"");
        tx.execute(create.as_str()).await?;
    }
    let ddl = bookkeeping(BOOKKEEPING_DDL);
    tx.execute(ddl.as_str()).await?;
    let exists = sqlx::query(TABLE_EXISTS)
        .bind(table.schema())
        .bind(table.bare())
        .fetch_optional(&mut *tx)
        .await?
        .is_some();
    if !exists {
        // The table was dropped since: its bookkeeping no longer describes anything.
        let forget = bookkeeping(FORGET_MIGRATIONS);
        sqlx::query(&forget)
            .bind(table.bare())
            .execute(&mut *tx)
            .await?;
    }
    let applied_sql = bookkeeping(APPLIED_MIGRATIONS);
    let applied: Vec<i32> = sqlx::query_scalar(&applied_sql)
        .bind(table.bare())
        .fetch_all(&mut *tx)
        .await?;
    let record = bookkeeping(RECORD_MIGRATION);
    for &(version, ddl) in MIGRATIONS {
        if applied.contains(&version) {
            continue;
        }
        // No bind parameters: the simple protocol, which runs the file's several statements.
        let ddl = table.render_ddl(ddl);
        tx.execute(ddl.as_str()).await?;
        sqlx::query(&record)
            .bind(table.bare())
            .bind(version)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

/// An error while opening: transient ones are retryable store errors, the rest are
/// configuration to fix.
fn open_error(e: sqlx::Error, what: String) -> IdemError {
    let e = map_err(e);
    if e.retryable {
        IdemError::store(
            "opening the PostgreSQL store",
            StoreError::new(true, format!("{what}: {}", e.source)),
        )
    } else {
        IdemError::Config {
            message: format!("{what}: {}", e.source),
        }
    }
}

/// SQLSTATEs a retry can clear: serialization failure, deadlock, lock timeout, statement
/// timeout, server shutting down or starting, too many connections, and the connection
/// exception class.
fn retryable_code(code: &str) -> bool {
    matches!(
        code,
        "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03" | "53300"
    ) || code.starts_with("08")
}

/// SQLSTATEs that mean the server cannot be reached: the connection exception class and
/// a server shutting down, crashed or starting. Not contention, refusals or conflicts.
fn unreachable_code(code: &str) -> bool {
    code.starts_with("08") || code.starts_with("57P")
}

/// Maps a driver error to a [`StoreError`], retryable when a retry can clear it.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    sql_common::map_sqlx(e, retryable_code, unreachable_code)
}

fn claim_row(row: &PgRow) -> Result<ClaimRow, sqlx::Error> {
    Ok(ClaimRow {
        mine: row.try_get("mine")?,
        stale: row.try_get("stale")?,
        state: i64::from(row.try_get::<i16, _>("state")?),
        epoch: row.try_get("epoch")?,
        same_fingerprint: row.try_get("same_fingerprint")?,
        taken_over: row.try_get("taken_over")?,
        retry_after_ms: row.try_get("retry_after_ms")?,
        outcome: row.try_get("outcome")?,
        outcome_is_err: row.try_get("outcome_is_err")?,
        outcome_version: i64::from(row.try_get::<i32, _>("outcome_version")?),
    })
}

fn fence(rows: u64) -> Fence {
    if rows == 0 { Fence::Lost } else { Fence::Held }
}

/// The `NOTIFY` payload naming an operation.
fn wake_payload(id: &OperationId) -> Result<String, StoreError> {
    serde_json::to_string(id).map_err(|e| StoreError::new(false, e))
}

impl PgStore {
    /// Runs a hot statement on idem's own connections, or on the application's pool.
    async fn fetch_optional(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Option<PgRow>, sqlx::Error> {
        match &self.owned {
            Some(conns) => conns.fetch_optional(query).await,
            None => query.fetch_optional(&self.pool).await,
        }
    }

    /// One fenced write that ends a claim (and wakes waiters): `held` decides the fence.
    async fn ending(
        &self,
        sql: &str,
        id: &OperationId,
        epoch: u64,
        outcome: Option<(&StoredOutcome, Duration)>,
    ) -> Result<Fence, StoreError> {
        let Some(epoch) = sql_epoch(epoch) else {
            return Ok(Fence::Lost);
        };
        let mut query = sqlx::query(sql)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .bind(epoch)
            .bind(wake_payload(id)?);
        if let Some((outcome, retain)) = outcome {
            query = query
                .bind(&outcome.body)
                .bind(outcome.is_err)
                .bind(sql_version(outcome.version)?)
                .bind(millis(retain));
        }
        let row = self
            .fetch_optional(query)
            .await
            .and_then(|row| row.ok_or(sqlx::Error::RowNotFound))
            .map_err(map_err)?;
        let held: i64 = row.try_get("held").map_err(map_err)?;
        Ok(fence(u64::try_from(held).unwrap_or(0)))
    }
}

#[async_trait::async_trait]
impl Store for PgStore {
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // The events below carry no key: the caller's `idem` span does, hashed when asked.
        for attempt in 0..CLAIM_ATTEMPTS {
            if attempt > 0 {
                // Back off (1, 2, 4, 8 ms) so racing writers settle instead of spinning.
                tokio::time::sleep(Duration::from_millis(1 << (attempt - 1))).await;
            }
            let row = sqlx::query(&self.sql.claim)
                .bind(&req.id.scope)
                .bind(&req.id.name)
                .bind(&req.id.key)
                .bind(&req.fingerprint[..])
                .bind(millis(req.lease))
                .bind(req.on_takeover == Takeover::Unknown);
            let row = self.fetch_optional(row).await;
            let row = match row {
                // Under a SERIALIZABLE or REPEATABLE READ default the race surfaces as a
                // serialization failure instead; the statement is its own transaction, so
                // issuing it again is as safe as for the empty result below.
                Err(sqlx::Error::Database(e))
                    if matches!(e.code().as_deref(), Some("40001" | "40P01")) =>
                {
                    tracing::trace!(error = %e, "claim conflicted; issuing it again");
                    continue;
                }
                row => row.map_err(map_err)?,
            };
            let Some(row) = row else {
                tracing::trace!("claim raced a concurrent commit; issuing it again");
                continue;
            };
            match decide(claim_row(&row).map_err(map_err)?)? {
                Decision::Claim(claim) => return Ok(claim),
                Decision::Reissue => {
                    tracing::trace!("claim read a superseded row; issuing it again");
                }
            }
        }
        Err(StoreError::new(
            true,
            format!(
                "the claim of operation `{}` raced concurrent writers {CLAIM_ATTEMPTS} times in \
                 a row; retry",
                req.id.name
            ),
        ))
    }

    async fn record(
        &self,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        self.ending(&self.sql.record, id, epoch, Some((outcome, retain)))
            .await
    }

    async fn release(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.ending(&self.sql.release, id, epoch, None).await
    }

    async fn mark_unknown(&self, id: &OperationId, epoch: u64) -> Result<Fence, StoreError> {
        self.ending(&self.sql.mark_unknown, id, epoch, None).await
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
            None => self.ending(&self.sql.resolve_delete, id, epoch, None).await,
            Some(outcome) => {
                self.ending(&self.sql.resolve_record, id, epoch, Some(outcome))
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
            let code: i16 = row.try_get("state").map_err(map_err)?;
            let n: i64 = row.try_get("n").map_err(map_err)?;
            let oldest: i64 = row.try_get("oldest_ms").map_err(map_err)?;
            let n = u64::try_from(n).unwrap_or(0);
            match State::from_code(i64::from(code)) {
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
        let read = || -> Result<_, sqlx::Error> {
            Ok((
                i64::from(row.try_get::<i16, _>("state")?),
                row.try_get::<i64, _>("epoch")?,
                row.try_get::<i64, _>("age_ms")?,
                row.try_get::<Option<i64>, _>("lease_ms")?,
                row.try_get::<Option<i64>, _>("expires_ms")?,
                row.try_get::<Option<Vec<u8>>, _>("outcome")?,
                row.try_get::<bool, _>("outcome_is_err")?,
                i64::from(row.try_get::<i32, _>("outcome_version")?),
            ))
        };
        let (state, epoch, age, lease, expires, outcome, is_err, version) =
            read().map_err(map_err)?;
        sql_common::record_detail(
            id, state, epoch, age, lease, expires, outcome, is_err, version,
        )
        .map(Some)
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<RecordInfo>, StoreError> {
        let rows = sqlx::query(&self.sql.list)
            .bind(filter.state.map(State::code))
            .bind(filter.name.as_deref())
            .bind(filter.older_than.map(millis))
            .bind(i64::from(filter.limit()))
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.iter()
            .map(|row| {
                let code: i16 = row.try_get("state").map_err(map_err)?;
                Ok(RecordInfo {
                    id: OperationId {
                        scope: row.try_get("scope").map_err(map_err)?,
                        name: row.try_get("name").map_err(map_err)?,
                        key: row.try_get("key").map_err(map_err)?,
                    },
                    state: State::from_code(i64::from(code))
                        .ok_or_else(|| corrupt(format!("unknown state code {code}")))?,
                    epoch: epoch_from_sql(row.try_get("epoch").map_err(map_err)?)?,
                    age: duration_ms(row.try_get("age_ms").map_err(map_err)?),
                })
            })
            .collect()
    }

    async fn announce_wait(&self, id: &OperationId) -> Result<(), StoreError> {
        sqlx::query(&self.sql.announce_wait)
            .bind(&id.scope)
            .bind(&id.name)
            .bind(&id.key)
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(())
    }

    fn attach_wakers(&self, hub: Arc<WakeHub>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "idem: no tokio runtime when attaching PostgreSQL wakers; waiters on other \
                 processes' operations will poll instead of being woken"
            );
            return;
        };
        let options = (*self.pool.connect_options()).clone();
        let task = AbortOnDrop(runtime.spawn(listen(options, hub)));
        let mut listener = self.listener.lock().unwrap_or_else(|p| p.into_inner());
        // A second attach replaces the first (dropping it aborts the old task).
        *listener = Some(task);
    }
}

/// The wake listener: one dedicated connection (its own pool of one, so it never takes a
/// connection from the store's pool) that `LISTEN`s on [`WAKE_CHANNEL`] and wakes this
/// process's waiters. `PgListener` reconnects and re-subscribes by itself; notifications
/// sent while it was down are lost, and those waiters fall back to polling the lease.
async fn listen(options: PgConnectOptions, hub: Arc<WakeHub>) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(100);
    const MAX_BACKOFF: Duration = Duration::from_secs(30);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options);
    let mut backoff = FIRST_BACKOFF;
    let mut listener = loop {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(WAKE_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match connected.await {
            Ok(listener) => break listener,
            Err(e) => {
                tracing::warn!(error = %e, "idem: cannot LISTEN for wake-ups; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    };
    backoff = FIRST_BACKOFF;
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                backoff = FIRST_BACKOFF;
                match serde_json::from_str::<OperationId>(notification.payload()) {
                    Ok(id) => hub.wake(&id),
                    Err(e) => tracing::debug!(error = %e, "idem: ignoring a malformed wake-up"),
                }
            }
            Ok(None) => {
                tracing::debug!("idem: wake listener reconnected; wake-ups meanwhile were lost");
            }
            Err(e) => {
                tracing::warn!(error = %e, "idem: wake listener failed; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Transactional mode: claims `id` inside the caller's transaction on `conn`.
///
/// A concurrent duplicate's insert blocks on this row until this transaction ends (bound
/// it with `lock_timeout`), then replays what was committed, or claims if this one rolled
/// back. Under REPEATABLE READ or SERIALIZABLE the conflict is a serialization failure,
/// returned as a retryable error.
pub(crate) async fn tx_claim_pg(
    conn: &mut PgConnection,
    store: &PgStore,
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
    conn: &'a mut PgConnection,
    sql: &'a Statements,
    id: &'a OperationId,
    fingerprint: &'a [u8; 32],
    lease: i64,
}

impl TxConn<'_> {
    /// One statement over (scope, name, key, fingerprint), and the lease if it takes one.
    async fn step(&mut self, sql: &str, lease: bool) -> Result<Option<PgRow>, StoreError> {
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
                state: i64::from(row.try_get::<i16, _>("state")?),
                epoch: row.try_get("epoch")?,
                retry_after_ms: row.try_get("retry_after_ms")?,
                outcome: row.try_get("outcome")?,
                outcome_is_err: row.try_get("outcome_is_err")?,
                outcome_version: i64::from(row.try_get::<i32, _>("outcome_version")?),
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
pub(crate) async fn tx_record_pg(
    conn: &mut PgConnection,
    store: &PgStore,
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
        .bind(sql_version(outcome.version)?)
        .bind(millis(retain))
        .execute(conn)
        .await
        .map_err(map_err)?;
    Ok(fence(done.rows_affected()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: [u8; 32] = [1; 32];
    const OTHER_FP: [u8; 32] = [2; 32];
    const LEASE: Duration = Duration::from_secs(60);
    const DAY: Duration = Duration::from_secs(86_400);

    fn url() -> String {
        std::env::var("IDEM_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    /// A store on its own table, dropped (with its bookkeeping) by [`TestDb::cleanup`].
    struct TestDb {
        store: PgStore,
        admin: PgPool,
        table: String,
    }

    /// Whether anything listens at the URL's host and port, asked once with a short
    /// timeout, so a machine without PostgreSQL skips at once rather than waiting out a
    /// pool's connect timeout in every test.
    fn reachable(url: &str) -> bool {
        static UP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *UP.get_or_init(|| {
            use std::net::ToSocketAddrs;
            let Ok(opts) = PgConnectOptions::from_str(url) else {
                return false;
            };
            (opts.get_host(), opts.get_port())
                .to_socket_addrs()
                .is_ok_and(|mut addrs| {
                    addrs.any(|a| {
                        std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok()
                    })
                })
        })
    }

    impl TestDb {
        /// `None` (after one line on stdout) when PostgreSQL is not reachable, unless
        /// `IDEM_REQUIRE_DB=1`.
        async fn new(test: &str) -> Option<TestDb> {
            Self::with_table(&format!("idem_t_{test}_{}", std::process::id())).await
        }

        async fn with_table(table: &str) -> Option<TestDb> {
            let url = url();
            let required = std::env::var("IDEM_REQUIRE_DB").as_deref() == Ok("1");
            let skip = || {
                use std::io::Write;
                // Straight to stderr: the harness captures `println!` of passing tests.
                let _ = writeln!(
                    std::io::stderr(),
                    "skipping: PostgreSQL not reachable at {} (set IDEM_POSTGRES_URL)",
                    redact_url(&url)
                );
            };
            if !required && !reachable(&url) {
                skip();
                return None;
            }
            let admin = match PgPoolOptions::new().max_connections(2).connect(&url).await {
                Ok(pool) => pool,
                Err(_) if !required => {
                    skip();
                    return None;
                }
                Err(e) => panic!("PostgreSQL not reachable at {url} and IDEM_REQUIRE_DB=1: {e}"),
            };
            drop_table(&admin, table).await;
            let opts = SqlOptions {
                table: table.to_owned(),
                migrate: true,
                ..SqlOptions::default()
            };
            let store = open(&url, &opts).await.expect("open PostgreSQL store");
            Some(TestDb {
                store,
                admin,
                table: table.to_owned(),
            })
        }

        async fn cleanup(self) {
            let TestDb {
                store,
                admin,
                table,
            } = self;
            store.pool.close().await;
            drop_table(&admin, &table).await;
        }
    }

    async fn drop_table(admin: &PgPool, table: &str) {
        let name = TableName::parse(table, true).unwrap();
        let drop = format!(
            "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP SEQUENCE IF EXISTS {}",
            name.qualified(),
            name.companion("_meta"),
            name.companion("_epoch_seq")
        );
        admin.execute(drop.as_str()).await.expect("drop test table");
        let forget = format!(
            "DO $$ BEGIN IF to_regclass('{bk}') IS NOT NULL THEN \
             DELETE FROM {bk} WHERE table_name = '{bare}'; END IF; END $$",
            bk = name.sibling("idem_schema_migrations"),
            bare = name.bare(),
        );
        admin
            .execute(forget.as_str())
            .await
            .expect("forget test bookkeeping");
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

    async fn claim(store: &PgStore, id: &OperationId, fp: [u8; 32], lease: Duration) -> Claim {
        store.claim(&req(id, fp, lease)).await.expect("claim")
    }

    #[tokio::test]
    async fn conformance() {
        let Some(db) = TestDb::new("conformance").await else {
            return;
        };
        crate::store::conformance::run_all(&db.store).await;
        db.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_claims_on_a_fresh_key_acquire_once() {
        let Some(db) = TestDb::new("concurrent").await else {
            return;
        };
        let store = Arc::new(db.store);
        for round in 0..3 {
            let id = Arc::new(op(&format!("hot-{round}")));
            let barrier = Arc::new(tokio::sync::Barrier::new(50));
            let tasks: Vec<_> = (0..50)
                .map(|_| {
                    let (store, id, barrier) = (store.clone(), id.clone(), barrier.clone());
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
                        takeover: false, ..
                    } => acquired += 1,
                    Claim::InFlight { .. } => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(acquired, 1, "round {round}");
        }
        let store = Arc::into_inner(store).expect("tasks done");
        TestDb { store, ..db }.cleanup().await;
    }

    #[tokio::test]
    async fn schema_qualified_table_and_reopen() {
        let schema = format!("idem_s_{}", std::process::id());
        let table = format!("{schema}.ops");
        let Some(db) = TestDb::with_table(&table).await else {
            return;
        };
        let id = op("q-1");
        assert!(matches!(
            claim(&db.store, &id, FP, LEASE).await,
            Claim::Acquired {
                takeover: false,
                ..
            }
        ));
        // Opening again (as another process would) finds the table migrated and keeps it.
        let opts = SqlOptions {
            table: table.clone(),
            migrate: true,
            ..SqlOptions::default()
        };
        let again = open(&url(), &opts).await.unwrap();
        assert!(matches!(
            claim(&again, &id, FP, LEASE).await,
            Claim::InFlight { .. }
        ));
        let no_ddl = SqlOptions {
            table: table.clone(),
            migrate: false,
            ..SqlOptions::default()
        };
        assert!(from_pool(db.admin.clone(), &no_ddl).await.is_ok());
        let admin = db.admin.clone();
        db.cleanup().await;
        let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        admin.execute(drop.as_str()).await.unwrap();
    }

    #[tokio::test]
    async fn concurrent_opens_migrate_once() {
        let Some(db) = TestDb::new("opens").await else {
            return;
        };
        db.cleanup().await;
        let table = format!("idem_t_opens_{}", std::process::id());
        let opts = SqlOptions {
            table: table.clone(),
            migrate: true,
            ..SqlOptions::default()
        };
        let url = url();
        let opens: Vec<_> = (0..6)
            .map(|_| {
                let (url, opts) = (url.clone(), opts.clone());
                tokio::spawn(async move { open(&url, &opts).await })
            })
            .collect();
        let mut stores = Vec::new();
        for handle in opens {
            stores.push(handle.await.unwrap().expect("concurrent open"));
        }
        let admin = stores[0].pool.clone();
        let versions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_schema_migrations WHERE table_name = $1")
                .bind(&table)
                .fetch_one(&admin)
                .await
                .unwrap();
        assert_eq!(versions, i64::try_from(MIGRATIONS.len()).unwrap());
        drop_table(&admin, &table).await;
    }

    #[tokio::test]
    async fn missing_table_without_migrate_is_a_config_error() {
        let Some(db) = TestDb::new("nomigrate").await else {
            return;
        };
        let opts = SqlOptions {
            table: format!("idem_t_absent_{}", std::process::id()),
            migrate: false,
            ..SqlOptions::default()
        };
        match from_pool(db.admin.clone(), &opts).await {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("POSTGRES_SCHEMA_SQL"), "{message}")
            }
            other => panic!("expected Config, got {:?}", other.err()),
        }
        let bad = SqlOptions {
            table: "a.b.c".into(),
            migrate: true,
            ..SqlOptions::default()
        };
        assert!(matches!(
            from_pool(db.admin.clone(), &bad).await,
            Err(IdemError::Config { .. })
        ));
        db.cleanup().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn record_wakes_waiters_in_other_processes() {
        let Some(db) = TestDb::new("wake").await else {
            return;
        };
        let hub = Arc::new(WakeHub::default());
        db.store.attach_wakers(hub.clone());
        let wait = |id: &OperationId| hub.register(id, 10).expect("register waiter");

        // Until the listener is subscribed, NOTIFY by hand: this proves it is listening.
        let probe = op("probe");
        let waiter = wait(&probe);
        let payload = wake_payload(&probe).unwrap();
        let listening = async {
            loop {
                let notified = waiter.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                sqlx::query("SELECT pg_notify('idem_wake', $1)")
                    .bind(&payload)
                    .execute(&db.admin)
                    .await
                    .unwrap();
                if tokio::time::timeout(Duration::from_millis(200), notified)
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(30), listening)
            .await
            .expect("the wake listener never subscribed");

        // Another process (the admin pool) records; the waiter announced itself first.
        let id = op("w-1");
        let Claim::Acquired { epoch, .. } = claim(&db.store, &id, FP, LEASE).await else {
            panic!("fresh claim expected");
        };
        let waiter = wait(&id);
        let notified = waiter.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        db.store.announce_wait(&id).await.unwrap();
        let other = from_pool(
            db.admin.clone(),
            &SqlOptions {
                table: db.table.clone(),
                migrate: false,
                ..SqlOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(
            other.record(&id, epoch, &outcome("1"), DAY).await.unwrap(),
            Fence::Held
        );
        tokio::time::timeout(Duration::from_secs(30), notified)
            .await
            .expect("record did not wake the waiter");

        // Without an announced waiter, nothing is sent.
        let quiet = op("w-2");
        let Claim::Acquired { epoch, .. } = claim(&db.store, &quiet, FP, LEASE).await else {
            panic!("fresh claim expected");
        };
        let row = sqlx::query(&other.sql.release)
            .bind(&quiet.scope)
            .bind(&quiet.name)
            .bind(&quiet.key)
            .bind(epoch as i64)
            .bind(wake_payload(&quiet).unwrap())
            .fetch_one(&db.admin)
            .await
            .unwrap();
        assert_eq!(
            (row.get::<i64, _>("held"), row.get::<i64, _>("woke")),
            (1, 0)
        );
        db.cleanup().await;
    }

    #[tokio::test]
    async fn listener_stops_with_the_store() {
        let Some(db) = TestDb::new("listener").await else {
            return;
        };
        let hub = Arc::new(WakeHub::default());
        db.store.attach_wakers(hub.clone());
        // The task holds a clone of the hub; dropping the store aborts it and frees it.
        assert_eq!(Arc::strong_count(&hub), 2);
        let TestDb {
            store,
            admin,
            table,
        } = db;
        drop(store);
        tokio::time::timeout(Duration::from_secs(10), async {
            while Arc::strong_count(&hub) > 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("listener task still running after the store was dropped");
        drop_table(&admin, &table).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn transactional_claim_blocks_then_replays() {
        let Some(db) = TestDb::new("tx").await else {
            return;
        };
        let store = Arc::new(db.store);
        let id = op("tx-1");
        let mut first = store.pool.begin().await.unwrap();
        assert!(matches!(
            tx_claim_pg(&mut first, &store, &id, &FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Acquired { .. }
        ));
        assert!(matches!(
            tx_claim_pg(&mut first, &store, &id, &FP, LEASE)
                .await
                .unwrap(),
            TxClaim::InFlight { .. }
        ));

        // A concurrent duplicate blocks on the row until the first commits, then replays.
        let second = {
            let (store, id) = (store.clone(), id.clone());
            tokio::spawn(async move {
                let mut tx = store.pool.begin().await.unwrap();
                let claim = tx_claim_pg(&mut tx, &store, &id, &FP, LEASE).await;
                tx.rollback().await.unwrap();
                claim
            })
        };
        let done = outcome("\"tx\"");
        assert_eq!(
            tx_record_pg(&mut first, &store, &id, &done, DAY)
                .await
                .unwrap(),
            Fence::Held
        );
        first.commit().await.unwrap();
        assert_eq!(
            second.await.unwrap().unwrap(),
            TxClaim::Completed(done.clone())
        );

        let mut tx = store.pool.begin().await.unwrap();
        assert_eq!(
            tx_claim_pg(&mut tx, &store, &id, &OTHER_FP, LEASE)
                .await
                .unwrap(),
            TxClaim::Mismatch
        );
        tx.rollback().await.unwrap();

        // Rollback is the release: the blocked duplicate claims.
        let rolled = op("tx-2");
        let mut first = store.pool.begin().await.unwrap();
        tx_claim_pg(&mut first, &store, &rolled, &FP, LEASE)
            .await
            .unwrap();
        let second = {
            let (store, rolled) = (store.clone(), rolled.clone());
            tokio::spawn(async move {
                let mut tx = store.pool.begin().await.unwrap();
                let claim = tx_claim_pg(&mut tx, &store, &rolled, &OTHER_FP, LEASE).await;
                tx.rollback().await.unwrap();
                claim
            })
        };
        first.rollback().await.unwrap();
        assert!(matches!(
            second.await.unwrap().unwrap(),
            TxClaim::Acquired { .. }
        ));

        // Under REPEATABLE READ the conflict is a retryable serialization failure.
        let serial = op("tx-3");
        let mut first = store.pool.begin().await.unwrap();
        tx_claim_pg(&mut first, &store, &serial, &FP, LEASE)
            .await
            .unwrap();
        let second = {
            let (store, serial) = (store.clone(), serial.clone());
            tokio::spawn(async move {
                let mut tx = store.pool.begin().await.unwrap();
                tx.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .await
                    .unwrap();
                tx.execute("SELECT 1").await.unwrap(); // take the snapshot now
                tokio::time::sleep(Duration::from_millis(50)).await;
                let claim = tx_claim_pg(&mut tx, &store, &serial, &FP, LEASE).await;
                let _ = tx.rollback().await;
                claim
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx_record_pg(&mut first, &store, &serial, &done, DAY)
            .await
            .unwrap();
        first.commit().await.unwrap();
        match second.await.unwrap() {
            Err(e) => assert!(e.retryable, "{e}"),
            // The duplicate's snapshot may have started after the commit: then it replays.
            Ok(claim) => assert_eq!(claim, TxClaim::Completed(done)),
        }

        let store = Arc::into_inner(store).expect("tasks done");
        TestDb { store, ..db }.cleanup().await;
    }

    #[test]
    fn transient_sqlstates_are_retryable() {
        for code in ["40001", "40P01", "55P03", "08006", "57P01"] {
            assert!(retryable_code(code), "{code}");
        }
        for code in ["23505", "42P01", "42601", "22P02"] {
            assert!(!retryable_code(code), "{code}");
        }
    }
}
