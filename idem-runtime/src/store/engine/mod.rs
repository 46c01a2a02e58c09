//! The SQL engine: the state machine's SQL side, written once for every SQL backend.
//!
//! [`SqlStore`] implements [`Store`](crate::store::Store) over a [`Dialect`], which says
//! only what differs between databases: how to run a statement and read its rows, the
//! clock and epoch expressions, error classes, whether the server rolled a caller's
//! transaction back, and hooks (PostgreSQL's snapshot re-issue, wake-ups, its own
//! connections). [`SqlDb`] ties sqlx's type for the database to its dialect, which is how
//! transactional mode and `Idem::from_pool` find the dialect from a transaction or a
//! pool. Statements live in `sql/<dialect>/<name>.sql` with named parameters (`:scope`,
//! `:epoch`, ...); rendering turns them into the dialect's positional placeholders once
//! per store.
//!
//! This file holds the dialect's trait, the store and what its calls share (the claim's
//! two statements, fenced writes, wake-ups, migrations); beside it:
//!
//! - `statements.rs`: the statements' names, checked when the crate compiles, their
//!   rendering, and what the claim's row decides;
//! - `store.rs`: the [`Store`](crate::store::Store) and [`Admin`](crate::store::Admin)
//!   impls, call by call;
//! - `tx.rs`: transactional mode's claim and record on the caller's connection;
//! - `table.rs`: the table's name and the stores' options;
//! - `values.rs`: arguments, rows, and the conversions between them and the store's types
//!   (the dialects reach the two only some of them use, `Val` and `decode_row`, there).

mod statements;
mod store;
mod table;
mod tx;
pub(crate) mod values;

use std::time::Duration;

use crate::error::{IdemError, StoreError};
use crate::store::{Claim, ClaimRequest, Fence, OperationId, ReplayGate, StoredOutcome, Takeover};

/// The SQL store an [`Idem`](crate::Idem) was opened on, one variant a database (named
/// through sqlx's type, so this file takes nothing from the dialects): transactional
/// mode finds it, typed, by the dialect of the caller's connection.
#[derive(Clone)]
pub(crate) enum SqlHandle {
    #[cfg(feature = "sqlite")]
    Sqlite(std::sync::Arc<SqlStore<<sqlx::Sqlite as SqlDb>::Dialect>>),
    #[cfg(feature = "postgres")]
    Postgres(std::sync::Arc<SqlStore<<sqlx::Postgres as SqlDb>::Dialect>>),
    #[cfg(feature = "mysql")]
    MySql(std::sync::Arc<SqlStore<<sqlx::MySql as SqlDb>::Dialect>>),
}

/// A dialect's `handle` and `handled`: its store in, and out of, the `SqlHandle`
/// variant named `$variant`.
macro_rules! handled_by {
    ($variant:ident) => {
        fn handle(store: std::sync::Arc<SqlStore<Self>>) -> SqlHandle {
            SqlHandle::$variant(store)
        }

        #[allow(
            unreachable_patterns,
            reason = "one variant when one SQL feature is on"
        )]
        fn handled(handle: &SqlHandle) -> Option<&SqlStore<Self>> {
            match handle {
                SqlHandle::$variant(store) => Some(store),
                _ => None,
            }
        }
    };
}
pub(crate) use handled_by;

impl SqlHandle {
    /// The handle on `store`.
    pub(crate) fn new<D: Dialect>(store: std::sync::Arc<SqlStore<D>>) -> SqlHandle {
        D::handle(store)
    }

    /// The store this handle holds, if it is of the dialect `D`.
    pub(crate) fn store<D: Dialect>(&self) -> Option<&SqlStore<D>> {
        D::handled(self)
    }
}

#[cfg(test)]
pub(crate) use statements::render_all;
use statements::{Decision, Statements, claim_row, decide};
pub(crate) use statements::{
    OptionalSql, Sql, Stmt, define_names, dialect_sql, dialect_sql_from_table, statement_table,
};
pub(crate) use table::{SqlOptions, TableName};
pub(crate) use tx::TxClaim;
pub(crate) use values::{Arg, Row, bind};
use values::{epoch_from_sql, lease_millis, millis, sql_epoch};

/// Where a statement runs.
pub(crate) enum On<'c, C> {
    /// The store's pool.
    Pool,
    /// The connections for claims and records (the pool, unless the dialect keeps its own).
    Hot,
    /// The caller's transaction (transactional mode).
    Conn(&'c mut C),
}

/// A claim or a record, owned, for a dialect that gathers concurrent ones into one
/// statement ([`Dialect::gathered`]).
#[derive(Debug)]
#[cfg_attr(not(feature = "_sql_group"), allow(dead_code))]
pub(crate) enum Gathered {
    /// The plain insert's parameters (`claim_fresh.sql`), for a key with no record.
    Fresh {
        id: OperationId,
        fp: [u8; 32],
        lease_ms: i64,
    },
    /// The claim statement's parameters.
    Claim {
        id: OperationId,
        fp: [u8; 32],
        lease_ms: i64,
        to_unknown: bool,
    },
    /// The record statement's parameters.
    Record {
        id: OperationId,
        epoch: i64,
        outcome: StoredOutcome,
        retain: Duration,
        payload: String,
    },
}

#[cfg_attr(not(feature = "_sql_group"), allow(dead_code))]
impl Gathered {
    /// The operation it claims or records.
    pub(crate) fn id(&self) -> &OperationId {
        match self {
            Gathered::Fresh { id, .. }
            | Gathered::Claim { id, .. }
            | Gathered::Record { id, .. } => id,
        }
    }

    /// The named parameters of its own statement (`claim.sql`, `record.sql`), as the
    /// engine binds them when it issues that statement itself.
    pub(crate) fn args(&self) -> Vec<(&'static str, Arg<'_>)> {
        match self {
            Gathered::Fresh { id, fp, lease_ms } => claim_args(id, fp, *lease_ms, false),
            Gathered::Claim {
                id,
                fp,
                lease_ms,
                to_unknown,
            } => claim_args(id, fp, *lease_ms, *to_unknown),
            Gathered::Record {
                id,
                epoch,
                outcome,
                retain,
                payload,
            } => {
                let mut args = fenced_args(id, *epoch, payload);
                args.extend(outcome_args(outcome, *retain));
                args
            }
        }
    }
}

/// What differs between SQL backends.
#[async_trait::async_trait]
pub(crate) trait Dialect: Send + Sync + std::fmt::Debug + Sized + 'static {
    /// The database.
    type Db: sqlx::Database<Connection = Self::Conn>;
    /// The connection under a caller's transaction.
    type Conn: sqlx::Connection<Database = Self::Db> + Send;
    /// The store's clock, as SQL (milliseconds on SQLite, a timestamp on PostgreSQL).
    const NOW: &'static str;
    /// The epoch a claim takes, as SQL: one never issued before for this table.
    const NEXT_EPOCH: &'static str;
    /// The name of the shipped schema's constant in `idem_runtime::schema`.
    const SCHEMA: &'static str;
    /// Whether the replay read (`peek.sql`) runs only while replays are recent, not on
    /// every call: where it is a round trip of its own, a fresh call would pay it for
    /// nothing (see [`ReplayGate`](super::ReplayGate)).
    const PEEK_WHILE_REPLAYING: bool = false;
    /// Whether the replay read runs on the claims' connections ([`On::Hot`]) rather than
    /// the pool: where those are the dialect's fastest path, not a single writer.
    const PEEK_ON_HOT: bool = false;
    /// How often the claim may be issued before giving up: more than once only where
    /// the database's snapshot rules can make it return no row.
    const CLAIM_ATTEMPTS: usize = 1;
    /// Whether placeholders carry their position (`$1`, `?1`), so a parameter used twice
    /// is bound once; MySQL's `?` binds by occurrence, each use bound again.
    const NUMBERED_PLACEHOLDERS: bool = true;

    /// Whether the claim statement takes a `:token` drawn afresh for each attempt
    /// ([`claim_token`]), which tells this attempt's row from another's (SQLite's
    /// `RETURNING` shows only the row after it).
    const CLAIM_TOKEN: bool = false;

    /// The statement template `name` (`sql/<dialect>/<file>.sql`). Made, with
    /// [`optional_sql`](Self::optional_sql), by the dialect's [`dialect_sql!`] call.
    fn sql(name: Sql) -> &'static str;
    /// The optional statement `name`, if the dialect has it.
    fn optional_sql(name: OptionalSql) -> Option<&'static str>;
    /// The placeholder for the `n`th parameter (1-based).
    fn placeholder(n: usize) -> String;
    /// A driver error as a store error: retryable, unreachable.
    fn map_err(e: sqlx::Error) -> StoreError;
    /// A conflict the claim may be issued again after (a serialization failure).
    fn is_conflict(_e: &sqlx::Error) -> bool {
        false
    }
    /// A statement that ended because it would have waited on another transaction's
    /// lock too long (the purge's wait limit).
    fn is_lock_wait(_e: &sqlx::Error) -> bool {
        false
    }

    /// Runs `stmt` and returns its rows.
    async fn fetch(
        &self,
        on: On<'_, Self::Conn>,
        stmt: &Stmt,
        args: Vec<Arg<'_>>,
    ) -> Result<Vec<Row>, sqlx::Error>;
    /// Begins the transaction migrations run in, holding whatever lock keeps processes
    /// that open the table at once from migrating it together.
    async fn begin_migrations(
        &self,
        table: &TableName,
    ) -> Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>;
    /// Runs `sql`, which may be several statements, on `conn`.
    async fn run_script(&self, conn: &mut Self::Conn, sql: &str) -> Result<(), sqlx::Error>;
    /// Runs `stmt` and returns how many rows it changed.
    async fn execute(&self, stmt: &Stmt, args: Vec<Arg<'_>>) -> Result<u64, sqlx::Error>;
    /// The store on an application's pool (`Idem::from_pool`), its table created unless
    /// `opts.migrate` is false.
    async fn from_pool(
        pool: sqlx::Pool<Self::Db>,
        opts: &SqlOptions,
    ) -> Result<SqlStore<Self>, IdemError>;

    /// Whether the server rolled the caller's whole transaction back on its own, idem's
    /// savepoints and claim with it, after a statement on `conn` failed: asked before
    /// telling the caller what to retry. No by default: PostgreSQL keeps a failed
    /// transaction open (aborted) until the caller ends it, and SQLite rolls one back on
    /// its own only on I/O or out-of-memory failures.
    async fn transaction_gone(&self, conn: &mut Self::Conn) -> bool {
        let _ = conn;
        false
    }

    /// This dialect's store as an `Idem` keeps it for transactional mode.
    fn handle(store: std::sync::Arc<SqlStore<Self>>) -> SqlHandle;

    /// The store `handle` holds, if it is of this dialect.
    fn handled(handle: &SqlHandle) -> Option<&SqlStore<Self>>;

    /// Starts waking this process's waiters when other processes finish operations.
    fn attach_wakers(&self, hub: std::sync::Arc<crate::store::WakeHub>) {
        let _ = hub;
    }
    /// Whether the claim or record about to be issued goes through
    /// [`Dialect::gathered`] (asked before each one).
    fn gathers(&self) -> bool {
        false
    }
    /// Runs a claim or a record in one statement with those waiting beside it, and
    /// returns the rows its own statement (`claim.sql`, `record.sql`) would have;
    /// `None` where the dialect does not gather (the caller issues that statement).
    async fn gathered(&self, op: Gathered) -> Option<Result<Vec<Row>, sqlx::Error>> {
        let _ = op;
        None
    }
}

/// sqlx's type for a database idem has a dialect for (`sqlx::MySql`), implemented in the
/// dialect's module: how a caller's `sqlx::Transaction` or `sqlx::Pool`, which name only
/// sqlx's type, reaches the dialect (`TxConnection`, `IntoStore`). Not a stable API;
/// sealed, as nothing outside the crate can name it.
#[doc(hidden)]
pub trait SqlDb: sqlx::Database {
    /// The dialect, on this database's connections.
    // The dialects are the crate's own; only the crate names this trait.
    #[allow(private_bounds)]
    type Dialect: Dialect<Db = Self, Conn = Self::Connection>;
}

/// A SQL store: one engine over a dialect.
#[derive(Debug)]
pub(crate) struct SqlStore<D: Dialect> {
    pub(crate) dialect: D,
    sql: Statements,
    gate: ReplayGate,
}

/// The claim statement's parameters (and `token`, where the dialect draws one).
fn claim_args<'a>(
    id: &'a OperationId,
    fp: &'a [u8],
    lease_ms: i64,
    to_unknown: bool,
) -> Vec<(&'static str, Arg<'a>)> {
    let mut named = id_args(id).to_vec();
    named.push(("fp", Arg::Bytes(fp)));
    named.push(("lease_ms", Arg::Int(lease_ms)));
    named.push(("to_unknown", Arg::Bool(to_unknown)));
    named
}

/// A fenced write's parameters, before the statement's own.
fn fenced_args<'a>(
    id: &'a OperationId,
    epoch: i64,
    payload: &'a str,
) -> Vec<(&'static str, Arg<'a>)> {
    let mut named = id_args(id).to_vec();
    named.push(("epoch", Arg::Int(epoch)));
    named.push(("payload", Arg::Text(payload)));
    named
}

fn id_args(id: &OperationId) -> [(&'static str, Arg<'_>); 3] {
    [
        ("scope", Arg::Text(&id.scope)),
        ("name", Arg::Text(&id.name)),
        ("key", Arg::Text(&id.key)),
    ]
}

/// The `NOTIFY` payload naming an operation, for dialects that wake other processes.
fn wake_payload(id: &OperationId) -> Result<String, StoreError> {
    serde_json::to_string(id).map_err(|e| StoreError::new(false, e))
}

impl<D: Dialect> SqlStore<D> {
    /// Issues `stmt` on the claim's and record's connections, or, where the dialect
    /// gathers at this moment, hands `op` to the next batch instead. The outer error is
    /// a parameter `stmt` cannot bind; the inner, the database's answer.
    async fn hot_or_gathered(
        &self,
        op: impl FnOnce() -> Gathered,
        stmt: &Stmt,
        named: &[(&str, Arg<'_>)],
    ) -> Result<Result<Vec<Row>, sqlx::Error>, StoreError> {
        if self.dialect.gathers()
            && let Some(rows) = self.dialect.gathered(op()).await
        {
            return Ok(rows);
        }
        Ok(self.dialect.fetch(On::Hot, stmt, stmt.args(named)?).await)
    }

    /// Claims a key that has no record with a plain insert (`claim_fresh.sql`), where
    /// the dialect has one, alone or gathered with other callers' (PostgreSQL's
    /// `claim_fresh_batch.sql`): the epoch, or `None` when the key exists (or the
    /// insert conflicted), for the full claim.
    async fn claim_fresh(
        &self,
        req: &ClaimRequest<'_>,
        named: &[(&str, Arg<'_>)],
    ) -> Result<Option<u64>, StoreError> {
        let Some(stmt) = &self.sql.claim_fresh else {
            return Ok(None);
        };
        let fresh = || Gathered::Fresh {
            id: req.id.clone(),
            fp: req.fingerprint,
            lease_ms: lease_millis(req.lease),
        };
        let rows = match self.hot_or_gathered(fresh, stmt, named).await? {
            Ok(rows) => rows,
            Err(e) if D::is_conflict(&e) => return Ok(None),
            Err(e) => return Err(D::map_err(e)),
        };
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        Ok(Some(epoch_from_sql(row.int("epoch")?)?))
    }

    /// Claims with the full claim statement (`claim.sql`), alone or gathered into a
    /// batch, which decides every case; issued again where the database's snapshot
    /// rules made it return no row.
    async fn claim_full(
        &self,
        req: &ClaimRequest<'_>,
        mut named: Vec<(&'static str, Arg<'_>)>,
    ) -> Result<Claim, StoreError> {
        // The events below carry no key: the caller's `idem` span does, hashed when asked.
        for attempt in 0..D::CLAIM_ATTEMPTS {
            if attempt > 0 {
                // Back off (1, 2, 4, 8 ms) so racing writers settle instead of spinning.
                tokio::time::sleep(Duration::from_millis(1 << (attempt - 1).min(6))).await;
            }
            let token = D::CLAIM_TOKEN.then(claim_token);
            named.retain(|(n, _)| *n != "token");
            if let Some(token) = token {
                named.push(("token", Arg::Int(token)));
            }
            let claim = || Gathered::Claim {
                id: req.id.clone(),
                fp: req.fingerprint,
                lease_ms: lease_millis(req.lease),
                to_unknown: req.on_takeover == Takeover::Unknown,
            };
            let rows = match self.hot_or_gathered(claim, &self.sql.claim, &named).await? {
                // Under SERIALIZABLE or REPEATABLE READ the snapshot race surfaces as a
                // serialization failure; the statement is its own transaction, so
                // issuing it again is safe.
                Err(e) if D::is_conflict(&e) && D::CLAIM_ATTEMPTS > 1 => {
                    tracing::trace!(error = %e, "claim conflicted; issuing it again");
                    continue;
                }
                rows => rows.map_err(D::map_err)?,
            };
            let Some(row) = rows.first() else {
                tracing::trace!("claim raced a concurrent commit; issuing it again");
                continue;
            };
            match decide(claim_row(row)?)? {
                Decision::Claim(claim) => return Ok(claim),
                Decision::Reissue => {
                    tracing::trace!("claim read a superseded row; issuing it again");
                }
            }
        }
        Err(StoreError::new(
            true,
            format!(
                "the claim of operation `{}` raced concurrent writers {} times in a row; retry",
                req.id.name,
                D::CLAIM_ATTEMPTS
            ),
        ))
    }

    /// Checks the table (every column idem reads) and its key mode, then renders the
    /// statements.
    pub(crate) async fn prepare(
        dialect: D,
        table: &TableName,
        key_mode: &str,
    ) -> Result<SqlStore<D>, IdemError> {
        let probe = Stmt::render::<D>(D::sql(Sql::Probe), table);
        dialect
            .fetch(On::Pool, &probe, Vec::new())
            .await
            .map_err(|e| {
                open_error::<D>(
                    e,
                    format!(
                        "the idem table `{table}` is missing or lacks idem's columns; create it \
                     with `idem_runtime::schema::{}` (renamed to `{table}`) or enable migrate",
                        D::SCHEMA
                    ),
                )
            })?;
        let set = Stmt::render::<D>(D::sql(Sql::SetKeyMode), table);
        let get = Stmt::render::<D>(D::sql(Sql::GetKeyMode), table);
        let mode = [("mode", Arg::Text(key_mode))];
        let recorded = async {
            dialect
                .fetch(On::Pool, &set, set.args(&mode).expect("mode"))
                .await?;
            dialect.fetch(On::Pool, &get, Vec::new()).await
        }
        .await
        .map_err(|e| open_error::<D>(e, format!("cannot read the key mode of `{table}`")))?;
        let recorded = match recorded.first() {
            Some(row) => row.opt_text("key_mode").map_err(|e| IdemError::Config {
                message: e.to_string(),
            })?,
            None => None,
        };
        table::check_key_mode(table, recorded, key_mode)?;
        Ok(SqlStore {
            sql: Statements::new::<D>(table),
            dialect,
            gate: ReplayGate::default(),
        })
    }

    async fn rows(
        &self,
        on: On<'_, D::Conn>,
        stmt: &Stmt,
        named: &[(&str, Arg<'_>)],
    ) -> Result<Vec<Row>, StoreError> {
        let args = stmt.args(named)?;
        self.dialect.fetch(on, stmt, args).await.map_err(D::map_err)
    }

    /// Wakes the callers waiting on `id` where a write's rows carry the `waiters` flag,
    /// which a write returns instead of waking them itself (the PostgreSQL record, alone
    /// or issued alone from a batch): the dialect's wake statement follows it. The write
    /// has committed: a waiter this misses still finds the outcome at its next poll, so
    /// a failure here fails nothing.
    async fn wake_waiters(&self, rows: &[Row], id: &OperationId) {
        let Some(wake) = &self.sql.wake else {
            return;
        };
        if !rows.iter().any(|r| r.flag("waiters").unwrap_or(false)) {
            return;
        }
        let woke = match wake_payload(id) {
            Ok(payload) => {
                self.rows(On::Hot, wake, &[("payload", Arg::Text(&payload))])
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = woke {
            tracing::debug!(error = %e, "idem: could not wake the waiters of a write");
        }
    }

    /// A fenced write: held when the statement reports a row it changed, then wakes
    /// the waiters the row reports ([`wake_waiters`](Self::wake_waiters)).
    async fn fenced(
        &self,
        stmt: &Stmt,
        id: &OperationId,
        epoch: u64,
        extra: &[(&str, Arg<'_>)],
    ) -> Result<Fence, StoreError> {
        let Some(epoch) = sql_epoch(epoch) else {
            return Ok(Fence::Lost);
        };
        let payload = wake_payload(id)?;
        let mut named = fenced_args(id, epoch, &payload);
        named.extend_from_slice(extra);
        let rows = self.rows(On::Hot, stmt, &named).await?;
        self.wake_waiters(&rows, id).await;
        fence(&rows)
    }

    async fn write_outcome(
        &self,
        stmt: &Stmt,
        id: &OperationId,
        epoch: u64,
        outcome: &StoredOutcome,
        retain: Duration,
    ) -> Result<Fence, StoreError> {
        let extra = outcome_args(outcome, retain);
        self.fenced(stmt, id, epoch, &extra).await
    }
}

/// Held when the fenced write's rows report a row it changed.
fn fence(rows: &[Row]) -> Result<Fence, StoreError> {
    let mut held = 0;
    for row in rows {
        held += row.int("held")?;
    }
    Ok(if held > 0 { Fence::Held } else { Fence::Lost })
}

fn outcome_args(outcome: &StoredOutcome, retain: Duration) -> [(&'static str, Arg<'_>); 4] {
    [
        ("outcome", Arg::Bytes(&outcome.body)),
        ("is_err", Arg::Bool(outcome.is_err)),
        ("version", Arg::Int(i64::from(outcome.version))),
        ("retain_ms", Arg::Int(millis(retain))),
    ]
}

/// Applies the migrations the table lacks, in one transaction under the dialect's lock,
/// so processes opening at once apply them one after another and the later ones find
/// nothing left to do. idem keeps its own bookkeeping table.
pub(crate) async fn migrate<D: Dialect>(
    dialect: &D,
    table: &TableName,
    migrations: &[(i64, &str)],
) -> Result<(), sqlx::Error> {
    let r = |name: Sql| Stmt::render::<D>(D::sql(name), table);
    let named = [
        ("table_name", Arg::Text(table.bare())),
        ("schema", Arg::OptText(table.schema())),
    ];
    let bind = |stmt: &Stmt, version: Option<i64>| {
        let mut all = named.to_vec();
        all.extend(version.map(|v| ("version", Arg::Int(v))));
        stmt.args(&all)
            .map_err(|e| sqlx::Error::Protocol(e.to_string()))
    };
    let mut tx = dialect.begin_migrations(table).await?;
    let bookkeeping = r(Sql::MigrationsBookkeeping);
    dialect.run_script(&mut tx, &bookkeeping.sql).await?;
    let exists = r(Sql::TableExists);
    let rows = dialect.fetch(On::Conn(&mut tx), &exists, bind(&exists, None)?);
    if rows.await?.is_empty() {
        // The table was dropped since: its bookkeeping no longer describes anything.
        let forget = r(Sql::ForgetMigrations);
        let args = bind(&forget, None)?;
        dialect.fetch(On::Conn(&mut tx), &forget, args).await?;
    }
    let applied = r(Sql::AppliedMigrations);
    let args = bind(&applied, None)?;
    let applied: Vec<i64> = dialect
        .fetch(On::Conn(&mut tx), &applied, args)
        .await?
        .iter()
        .filter_map(|row| row.int("version").ok())
        .collect();
    let record = r(Sql::RecordMigration);
    for &(version, ddl) in migrations {
        if applied.contains(&version) {
            continue;
        }
        dialect.run_script(&mut tx, &table.render_ddl(ddl)).await?;
        let args = bind(&record, Some(version))?;
        dialect.fetch(On::Conn(&mut tx), &record, args).await?;
    }
    tx.commit().await
}

/// An error while opening: transient ones are retryable store errors, the rest are
/// configuration to fix.
pub(crate) fn open_error<D: Dialect>(e: sqlx::Error, what: String) -> IdemError {
    let e = D::map_err(e);
    if e.retryable {
        IdemError::store(
            "opening the store",
            StoreError::new(true, format!("{what}: {}", e.source)),
        )
    } else {
        IdemError::Config {
            message: format!("{what}: {}", e.source),
        }
    }
}

/// Maps a driver error, with `retryable_code` and `unreachable_code` deciding for
/// database errors by their code (SQLite's extended result code, PostgreSQL's SQLSTATE).
pub(crate) fn map_sqlx(
    e: sqlx::Error,
    retryable_code: fn(&str) -> bool,
    unreachable_code: fn(&str) -> bool,
) -> StoreError {
    let (retryable, unreachable) = match &e {
        // A dropped connection, or every connection busy for the acquire timeout.
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => (true, true),
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => (retryable_code(&code), unreachable_code(&code)),
            None => (false, false),
        },
        _ => (false, false),
    };
    let mut err = StoreError::new(retryable, e);
    err.unreachable = unreachable;
    err
}

/// A fresh token per claim attempt: distinct within the process (a bijective mix of a
/// counter), and unpredictable across processes (seeded from the OS-keyed `RandomState`,
/// the process id and the start time). The current process id is mixed into every
/// token, so a forked child, which inherits the seed and the counter, draws another
/// stream. Only equality with the row's token matters.
pub(crate) fn claim_token() -> i64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_do_not_repeat() {
        let tokens: std::collections::HashSet<i64> = (0..10_000).map(|_| claim_token()).collect();
        assert_eq!(tokens.len(), 10_000);
    }
}
