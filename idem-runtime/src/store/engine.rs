//! The SQL engine: the state machine's SQL side, written once for every SQL backend.
//!
//! [`SqlStore`] implements [`Store`] over a [`Dialect`], which says only what differs
//! between databases: how to run a statement and read its rows, the clock and epoch
//! expressions, error classes, whether the server rolled a caller's transaction back,
//! and hooks (PostgreSQL's snapshot re-issue, wake-ups, its own connections). [`SqlDb`]
//! ties sqlx's type for the database to its dialect, which is how transactional mode and
//! `Idem::from_pool` find the dialect from a transaction or a pool. Statements live in
//! `sql/<dialect>/<name>.sql` with named parameters (`:scope`, `:epoch`, ...); rendering
//! turns them into the dialect's positional placeholders once per store.

use std::time::Duration;

use super::sql_common::{
    self, ClaimRow, Decision, SqlOptions, TableName, TxClaim, TxRow, corrupt, decide, duration_ms,
    epoch_from_sql, lease_millis, millis, outcome_from_sql, sql_epoch,
};
use super::{
    Admin, Claim, ClaimRequest, Fence, ListFilter, Mismatched, OperationId, RecordDetail,
    RecordInfo, ReplayGate, State, Stats, StepRecord, Store, StoreFuture, StoredOutcome, Takeover,
};
use crate::error::{IdemError, StoreError};

/// A value bound to a named parameter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    OptText(Option<&'a str>),
    Bytes(&'a [u8]),
    Int(i64),
    OptInt(Option<i64>),
    Bool(bool),
}

/// A column value read back, whatever the backend's type for it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Val {
    Null,
    Int(i64),
    Bool(bool),
    Text(String),
    Bytes(Vec<u8>),
}

/// One row: column names and values.
#[derive(Debug, Default)]
pub(crate) struct Row(pub(crate) Vec<(String, Val)>);

impl Row {
    pub(crate) fn val(&self, name: &str) -> Result<&Val, StoreError> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| corrupt(format!("no column `{name}` in a statement's row")))
    }

    fn opt_int(&self, name: &str) -> Result<Option<i64>, StoreError> {
        match self.val(name)? {
            Val::Null => Ok(None),
            Val::Int(i) => Ok(Some(*i)),
            Val::Bool(b) => Ok(Some(i64::from(*b))),
            other => Err(corrupt(format!("`{name}` is {other:?}, not a number"))),
        }
    }

    fn int(&self, name: &str) -> Result<i64, StoreError> {
        self.opt_int(name)?
            .ok_or_else(|| corrupt(format!("`{name}` is NULL")))
    }

    /// A boolean, which SQLite stores as an integer.
    fn flag(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.int(name)? != 0)
    }

    pub(crate) fn text(&self, name: &str) -> Result<String, StoreError> {
        match self.val(name)? {
            Val::Text(t) => Ok(t.clone()),
            other => Err(corrupt(format!("`{name}` is {other:?}, not text"))),
        }
    }

    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError> {
        match self.val(name)? {
            Val::Null => Ok(None),
            _ => self.text(name).map(Some),
        }
    }

    fn opt_bytes(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self.val(name)? {
            Val::Null => Ok(None),
            Val::Bytes(b) => Ok(Some(b.clone())),
            other => Err(corrupt(format!("`{name}` is {other:?}, not bytes"))),
        }
    }
}

/// The order parameters are numbered in, whatever order a statement uses them in.
const PARAM_ORDER: &[&str] = &[
    "scope",
    "name",
    "key",
    "fp",
    "token",
    "epoch",
    "payload",
    "lease_ms",
    "to_unknown",
    "outcome",
    "is_err",
    "version",
    "retain_ms",
    "state",
    "op_name",
    "older_ms",
    "limit",
    "mode",
    "table_name",
    "schema",
    "label",
];

/// A rendered statement: its text with positional placeholders, and which named
/// parameter each position takes.
#[derive(Debug)]
pub(crate) struct Stmt {
    pub(crate) sql: String,
    params: Vec<String>,
}

impl Stmt {
    /// Renders `template`: fragments and names (`{table}`, `{now}`, ...) filled in, each
    /// `:name` parameter replaced by the dialect's placeholder for its position.
    pub(crate) fn render<D: Dialect>(template: &str, table: &TableName) -> Stmt {
        let expanded = template
            // A shared fragment first: it holds the names below.
            .replace("{claim_conflict}", D::sql("claim_conflict").trim())
            // A released record resumes whatever `on_takeover` says: its last attempt
            // ended knowing what it had done.
            .replace("{rerun}", "(({lapsed} AND NOT :to_unknown) OR {released})")
            .replace(
                "{to_unknown}",
                "({lapsed} AND :to_unknown AND NOT {released})",
            )
            .replace("{lapsed}", D::sql("lapsed").trim())
            .replace("{released}", D::sql("released").trim())
            .replace("{expired}", D::sql("expired").trim())
            .replace("{next_epoch}", D::NEXT_EPOCH);
        let text = table.render(&expanded, D::NOW);
        // Two passes: find the parameters, number them in one canonical order (so a
        // statement's positions are the same wherever it is issued, benches included),
        // then write the placeholders.
        let mut params: Vec<String> = Vec::new();
        let mut spans = Vec::new();
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let starts_name = bytes[i] == b':'
                && (i == 0 || bytes[i - 1] != b':')
                && bytes.get(i + 1).is_some_and(|b| b.is_ascii_lowercase());
            if !starts_name {
                i += 1;
                continue;
            }
            let end = text[i + 1..]
                .find(|ch: char| !(ch.is_ascii_lowercase() || ch == '_'))
                .map_or(text.len(), |e| i + 1 + e);
            let name = &text[i + 1..end];
            if !params.iter().any(|p| p == name) {
                params.push(name.to_owned());
            }
            spans.push((i, end));
            i = end;
        }
        let rank = |p: &String| {
            PARAM_ORDER
                .iter()
                .position(|o| o == p)
                .unwrap_or(PARAM_ORDER.len())
        };
        params.sort_by_key(rank);
        if !D::NUMBERED_PLACEHOLDERS {
            params = spans
                .iter()
                .map(|&(start, end)| text[start + 1..end].to_owned())
                .collect();
        }
        let mut sql = String::with_capacity(text.len());
        let mut at = 0;
        for (n, (start, end)) in spans.into_iter().enumerate() {
            sql.push_str(&text[at..start]);
            let name = &text[start + 1..end];
            let pos = if D::NUMBERED_PLACEHOLDERS {
                params.iter().position(|p| p == name).expect("collected")
            } else {
                n
            };
            sql.push_str(&D::placeholder(pos + 1));
            at = end;
        }
        sql.push_str(&text[at..]);
        Stmt { sql, params }
    }

    /// The parameters' names in positional order (per placeholder where the dialect's
    /// placeholders are not numbered).
    #[cfg(any(feature = "mysql", feature = "postgres"))]
    pub(crate) fn param_names(&self) -> &[String] {
        &self.params
    }

    /// The arguments in this statement's positional order, from named ones.
    pub(crate) fn args<'a>(&self, named: &[(&str, Arg<'a>)]) -> Result<Vec<Arg<'a>>, StoreError> {
        self.params
            .iter()
            .map(|p| {
                named
                    .iter()
                    .find(|(n, _)| n == p)
                    .map(|(_, a)| *a)
                    .ok_or_else(|| corrupt(format!("no value for the parameter `:{p}`")))
            })
            .collect()
    }
}

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
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
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

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
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

    /// The statement template `name` (`sql/<dialect>/<name>.sql`).
    fn sql(name: &str) -> &'static str;
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

    /// A value that tells this claim attempt's row from another's, where the claim
    /// statement needs one (SQLite's `RETURNING` shows only the row after it).
    fn claim_token(&self) -> Option<i64> {
        None
    }
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

/// Binds `args` in order, whatever the database.
pub(crate) fn bind<'q, DB: sqlx::Database>(
    mut query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    args: Vec<Arg<'q>>,
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    bool: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    for arg in args {
        query = match arg {
            Arg::Text(t) => query.bind(t),
            Arg::OptText(t) => query.bind(t),
            Arg::Bytes(b) => query.bind(b),
            Arg::Int(i) => query.bind(i),
            Arg::OptInt(i) => query.bind(i),
            Arg::Bool(b) => query.bind(b),
        };
    }
    query
}

/// A row as the engine reads it, by each value's type as the database reports it.
/// (MySQL decodes its own: its binary and character strings share wire types.)
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn decode_row<R: sqlx::Row>(row: &R) -> Result<Row, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> i16: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    use sqlx::{Column, TypeInfo, ValueRef};
    let mut out = Vec::with_capacity(row.len());
    for (i, col) in row.columns().iter().enumerate() {
        let raw = row.try_get_raw(i)?;
        let kind = raw.type_info().name().to_owned();
        let val = if raw.is_null() {
            Val::Null
        } else {
            match kind.as_str() {
                "INT2" => Val::Int(i64::from(row.try_get::<i16, _>(i)?)),
                "INT4" => Val::Int(i64::from(row.try_get::<i32, _>(i)?)),
                "BOOL" => Val::Bool(row.try_get(i)?),
                "BYTEA" | "BLOB" => Val::Bytes(row.try_get(i)?),
                "TEXT" | "VARCHAR" | "NAME" => Val::Text(row.try_get(i)?),
                "VOID" => Val::Null,
                // INT8 and SQLite's INTEGER (its booleans too).
                _ => Val::Int(row.try_get(i)?),
            }
        };
        out.push((col.name().to_owned(), val));
    }
    Ok(Row(out))
}

/// A dialect's `Dialect::sql`: the statements of `sql/<dir>/` that every dialect has,
/// plus the optional ones it names, included at build time (an unknown name is the empty
/// string: a statement the dialect does not have).
macro_rules! statements {
    ($dir:literal $(, $extra:literal)* $(,)?) => {
        fn sql(name: &str) -> &'static str {
            macro_rules! file {
                ($name:literal) => {
                    include_str!(concat!("../../sql/", $dir, "/", $name, ".sql"))
                };
            }
            match name {
                "claim" => file!("claim"),
                "record" => file!("record"),
                "release" => file!("release"),
                "mark_unknown" => file!("mark_unknown"),
                "renew" => file!("renew"),
                "resolve_record" => file!("resolve_record"),
                "resolve_delete" => file!("resolve_delete"),
                "forget" => file!("forget"),
                "purge" => file!("purge"),
                "stats" => file!("stats"),
                "list" => file!("list"),
                "get" => file!("get"),
                "probe" => file!("probe"),
                "set_key_mode" => file!("set_key_mode"),
                "get_key_mode" => file!("get_key_mode"),
                "tx_claim" => file!("tx_claim"),
                "tx_read" => file!("tx_read"),
                "tx_reclaim" => file!("tx_reclaim"),
                "tx_takeover" => file!("tx_takeover"),
                "tx_record" => file!("tx_record"),
                "record_step" => file!("record_step"),
                "steps" => file!("steps"),
                "expired" => file!("expired"),
                "lapsed" => file!("lapsed"),
                "released" => file!("released"),
                "migrations_bookkeeping" => file!("migrations_bookkeeping"),
                "table_exists" => file!("table_exists"),
                "forget_migrations" => file!("forget_migrations"),
                "applied_migrations" => file!("applied_migrations"),
                "record_migration" => file!("record_migration"),
                $($extra => file!($extra),)*
                _ => "",
            }
        }
    };
}
pub(crate) use statements;

/// Every statement, rendered once for the store's table.
#[derive(Debug)]
struct Statements {
    claim: Stmt,
    claim_fresh: Option<Stmt>,
    peek: Option<Stmt>,
    record: Stmt,
    release: Stmt,
    mark_unknown: Stmt,
    renew: Stmt,
    resolve_record: Stmt,
    resolve_delete: Stmt,
    forget: Stmt,
    record_step: Stmt,
    steps: Stmt,
    announce_wait: Option<Stmt>,
    /// Sent after a fenced write whose row says a caller waits, where the write does
    /// not wake them itself.
    wake: Option<Stmt>,
    purge: Stmt,
    purge_locked: Option<Stmt>,
    stats: Stmt,
    list: Stmt,
    get: Stmt,
    tx_claim: Stmt,
    tx_read: Stmt,
    tx_reclaim: Stmt,
    tx_takeover: Stmt,
    tx_record: Stmt,
}

impl Statements {
    fn new<D: Dialect>(table: &TableName) -> Statements {
        let r = |name: &str| Stmt::render::<D>(D::sql(name), table);
        let optional = |name: &str| (!D::sql(name).is_empty()).then(|| r(name));
        Statements {
            claim: r("claim"),
            claim_fresh: optional("claim_fresh"),
            peek: optional("peek"),
            record: r("record"),
            release: r("release"),
            mark_unknown: r("mark_unknown"),
            renew: r("renew"),
            resolve_record: r("resolve_record"),
            resolve_delete: r("resolve_delete"),
            forget: r("forget"),
            record_step: r("record_step"),
            steps: r("steps"),
            announce_wait: optional("announce_wait"),
            wake: optional("wake"),
            purge: r("purge"),
            purge_locked: optional("purge_locked"),
            stats: r("stats"),
            list: r("list"),
            get: r("get"),
            tx_claim: r("tx_claim"),
            tx_read: r("tx_read"),
            tx_reclaim: r("tx_reclaim"),
            tx_takeover: r("tx_takeover"),
            tx_record: r("tx_record"),
        }
    }
}

/// The code `stats.sql` gives IN_PROGRESS records released with their steps kept
/// (`steps = 2`), beside the state codes: no claim holds them, so they are no stuck
/// claims.
const RELEASED: i64 = 3;

/// Records purged per statement, so a large purge does not lock many rows at once.
const PURGE_BATCH: i64 = 1000;

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
            let token = self.dialect.claim_token();
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
        let probe = Stmt::render::<D>(D::sql("probe"), table);
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
        let set = Stmt::render::<D>(D::sql("set_key_mode"), table);
        let get = Stmt::render::<D>(D::sql("get_key_mode"), table);
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
        sql_common::check_key_mode(table, recorded, key_mode)?;
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
    let r = |name: &str| Stmt::render::<D>(D::sql(name), table);
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
    let bookkeeping = r("migrations_bookkeeping");
    dialect.run_script(&mut tx, &bookkeeping.sql).await?;
    let exists = r("table_exists");
    let rows = dialect.fetch(On::Conn(&mut tx), &exists, bind(&exists, None)?);
    if rows.await?.is_empty() {
        // The table was dropped since: its bookkeeping no longer describes anything.
        let forget = r("forget_migrations");
        let args = bind(&forget, None)?;
        dialect.fetch(On::Conn(&mut tx), &forget, args).await?;
    }
    let applied = r("applied_migrations");
    let args = bind(&applied, None)?;
    let applied: Vec<i64> = dialect
        .fetch(On::Conn(&mut tx), &applied, args)
        .await?
        .iter()
        .filter_map(|row| row.int("version").ok())
        .collect();
    let record = r("record_migration");
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

fn claim_row(row: &Row) -> Result<ClaimRow, StoreError> {
    Ok(ClaimRow {
        mine: row.flag("mine")?,
        stale: match row.val("stale") {
            Ok(_) => row.flag("stale")?,
            Err(_) => false,
        },
        state: row.int("state")?,
        epoch: row.int("epoch")?,
        same_fingerprint: row.flag("same_fingerprint")?,
        taken_over: row.flag("taken_over")?,
        resume: row.flag("resume")?,
        retry_after_ms: row.int("retry_after_ms")?,
        outcome: row.opt_bytes("outcome")?,
        outcome_is_err: row.flag("outcome_is_err")?,
        outcome_version: row.int("outcome_version")?,
    })
}

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
                let window = [("retain_ms", Arg::Int(millis(super::RESUME_WINDOW)))];
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
            if n < PURGE_BATCH.unsigned_abs() {
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
        sql_common::record_detail(
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

impl<D: Dialect> sql_common::TxSteps for TxConn<'_, D> {
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
        sql_common::tx_claim(&mut TxConn {
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
