//! Group commit on PostgreSQL: while every connection is busy, concurrent claims (and
//! concurrent records) are gathered into one statement over arrays, one round trip and
//! one commit for the lot, each row decided alone and answered to its caller.

use std::sync::Arc;

use sqlx::postgres::{PgPool, PgRow};

use super::conns::{Conns, Query, hot};
use super::errors::unreachable_code;
use crate::store::engine::values::decode_row;
use crate::store::engine::{Arg, Gathered, Row, Stmt, bind};
use crate::store::group::Gather;

/// Batches of one kind in flight at once. One: while it waits for its commit, every
/// caller arriving joins the next batch. Two measure the same at 64 callers, within
/// the noise; four and more run below them (smaller batches, each paying its own
/// commit).
pub(super) const GROUP_WRITERS: usize = 1;

/// Group commit: concurrent claims (and concurrent records) are gathered into one
/// statement over arrays, one round trip and one commit for the lot, each row decided
/// alone and answered to its caller. A claim first joins the plain inserts of new keys
/// (`claim_fresh_batch.sql`), as a lone claim first tries `claim_fresh.sql`; one whose
/// key exists then joins the full claims (`claim_batch.sql`), which gather by takeover
/// policy, bound once per statement. Records: `record_batch.sql`.
#[derive(Debug)]
pub(super) struct PgGroup {
    pub(super) pool: PgPool,
    pub(super) owned: Option<Arc<Conns>>,
    pub(super) claim_fresh: Stmt,
    pub(super) claim: Stmt,
    pub(super) record: Stmt,
    pub(super) claim_fresh_batch: Stmt,
    pub(super) claim_batch: Stmt,
    pub(super) record_batch: Stmt,
    /// Claims whose takeover reruns (`[0]`) or marks UNKNOWN (`[1]`).
    pub(super) claims: [Gather<Waiting>; 2],
    /// Plain inserts of keys with no record yet.
    pub(super) fresh: Gather<Waiting>,
    pub(super) records: Gather<Waiting>,
}

/// A claim or record waiting for its batch, and where its rows go.
#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) op: Gathered,
    pub(super) reply: Reply,
}

type Reply = tokio::sync::oneshot::Sender<Result<Vec<Row>, sqlx::Error>>;

/// `statement`'s output, or `None` once every caller it answers has given up (its store
/// timeout passed, or it went away at its deadline): the statement's future is then
/// dropped, which closes its connection, so a batch on a connection gone silent does
/// not hold it past the callers' timeouts.
async fn while_awaited<T>(
    replies: &mut [&mut Reply],
    statement: impl std::future::Future<Output = T>,
) -> Option<T> {
    let gone = async {
        for reply in replies.iter_mut() {
            reply.closed().await;
        }
    };
    tokio::select! {
        biased;
        () = gone => None,
        out = statement => Some(out),
    }
}

/// Writes a gathered batch, as many statements as it has repeats of one key (a statement
/// may change a row once): the first of each key in the first, and so on. A statement of
/// one is the plain one, which is lighter.
pub(super) async fn write_batch(group: Arc<PgGroup>, batch: Vec<Waiting>) {
    let mut rest = batch;
    while !rest.is_empty() {
        let mut seen = std::collections::HashSet::new();
        let (mut now, later): (Vec<_>, Vec<_>) = rest
            .into_iter()
            .partition(|w| seen.insert(w.op.id().clone()));
        rest = later;
        if now.len() == 1 {
            alone(&group, now).await;
            continue;
        }
        let stmt = match now[0].op {
            Gathered::Fresh { .. } => &group.claim_fresh_batch,
            Gathered::Claim { .. } => &group.claim_batch,
            Gathered::Record { .. } => &group.record_batch,
        };
        let done = {
            let (ops, mut replies): (Vec<&Gathered>, Vec<&mut Reply>) =
                now.iter_mut().map(|w| (&w.op, &mut w.reply)).unzip();
            let calls: Vec<_> = ops.iter().map(|op| op.args()).collect();
            match bind_batch(stmt, &calls) {
                Ok(query) => {
                    let write = hot(&group.pool, group.owned.as_deref(), query);
                    while_awaited(&mut replies, write).await
                }
                Err(e) => Some(Err(e)),
            }
        };
        let Some(done) = done else {
            tracing::debug!("every caller of a batch gave up on it; its statement was dropped");
            continue;
        };
        match done {
            Ok(rows) => answer(now, &rows),
            Err(e) if refused(&e) => {
                tracing::debug!(error = %e, "group commit refused; issuing each alone");
                alone(&group, now).await;
            }
            Err(e) => fail_all(now, &e),
        }
    }
}

/// Whether the server refused a batch's statement on a connection that is still up: then
/// none of it took effect, and each call is issued alone, so that a refusal is its own
/// caller's. A connection-level failure (I/O, or SQLSTATE classes 08 and 57P: the
/// server went away, is going, or ended the session) is not a refusal: the server may
/// be down, and issuing each call again would meet it once per caller.
fn refused(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if !db.code().is_some_and(|c| unreachable_code(&c)))
}

/// Answers every caller of a failed batch with the same error, classified as its own
/// statement's would be (a connection-level failure stays unreachable and retryable).
fn fail_all(batch: Vec<Waiting>, e: &sqlx::Error) {
    for w in batch {
        let _ = w.reply.send(Err(copy_error(e)));
    }
}

/// Issues each one's own statement (`claim.sql`, `record.sql`), one after another.
async fn alone(group: &PgGroup, each: Vec<Waiting>) {
    for mut w in each {
        let stmt = match w.op {
            Gathered::Fresh { .. } => &group.claim_fresh,
            Gathered::Claim { .. } => &group.claim,
            Gathered::Record { .. } => &group.record,
        };
        let rows = match stmt.args(&w.op.args()) {
            Ok(args) => {
                let write = hot(
                    &group.pool,
                    group.owned.as_deref(),
                    bind(sqlx::query(&stmt.sql), args),
                );
                match while_awaited(&mut [&mut w.reply], write).await {
                    Some(rows) => rows.and_then(|rows| rows.iter().map(decode_row).collect()),
                    None => continue,
                }
            }
            Err(e) => Err(sqlx::Error::Protocol(e.to_string())),
        };
        let _ = w.reply.send(rows);
    }
}

/// Hands each caller the rows of its `ord` (1-based position in the batch).
fn answer(batch: Vec<Waiting>, rows: &[PgRow]) {
    let mut mine: Vec<Vec<Row>> = batch.iter().map(|_| Vec::new()).collect();
    for row in rows {
        let decoded =
            sqlx::Row::try_get::<i64, _>(row, "ord").and_then(|ord| Ok((ord, decode_row(row)?)));
        match decoded {
            Ok((ord, row)) => {
                if let Some(rows) = usize::try_from(ord - 1).ok().and_then(|i| mine.get_mut(i)) {
                    rows.push(row);
                }
            }
            Err(e) => {
                fail_all(batch, &e);
                return;
            }
        }
    }
    for (w, rows) in batch.into_iter().zip(mine) {
        let _ = w.reply.send(Ok(rows));
    }
}

/// Binds a batch statement's parameters from each call's own (`calls`, as its single
/// statement takes them): a parameter named `<name>s` takes the array of every call's
/// `<name>`; any other, the value the calls share (claims gather by takeover policy).
fn bind_batch<'q>(
    stmt: &'q Stmt,
    calls: &'q [Vec<(&'static str, Arg<'q>)>],
) -> Result<Query<'q>, sqlx::Error> {
    fn value<'q>(call: &[(&'static str, Arg<'q>)], name: &str) -> Result<Arg<'q>, sqlx::Error> {
        call.iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, a)| a)
            .ok_or_else(|| sqlx::Error::Protocol(format!("a batch call has no `{name}`")))
    }
    fn array<'q, T>(
        column: &[Arg<'q>],
        pick: fn(Arg<'q>) -> Option<T>,
    ) -> Result<Vec<T>, sqlx::Error> {
        column
            .iter()
            .map(|&a| {
                pick(a).ok_or_else(|| {
                    sqlx::Error::Protocol(format!("mixed types in a batch column: {a:?}"))
                })
            })
            .collect()
    }
    let mut query = sqlx::query(&stmt.sql);
    for name in &stmt.params {
        let first = calls.first().map_or(&[][..], Vec::as_slice);
        let Some(each) = name
            .strip_suffix('s')
            .filter(|one| first.iter().any(|(n, _)| n == one))
        else {
            query = bind(query, vec![value(first, name)?]);
            continue;
        };
        let column = calls
            .iter()
            .map(|call| value(call, each))
            .collect::<Result<Vec<_>, _>>()?;
        query = match column.first() {
            Some(Arg::Text(_)) => query.bind(array(&column, |a| match a {
                Arg::Text(t) => Some(t),
                _ => None,
            })?),
            Some(Arg::Bytes(_)) => query.bind(array(&column, |a| match a {
                Arg::Bytes(b) => Some(b),
                _ => None,
            })?),
            Some(Arg::Int(_)) => query.bind(array(&column, |a| match a {
                Arg::Int(i) => Some(i),
                _ => None,
            })?),
            Some(Arg::Bool(_)) => query.bind(array(&column, |a| match a {
                Arg::Bool(b) => Some(b),
                _ => None,
            })?),
            other => {
                return Err(sqlx::Error::Protocol(format!(
                    "no array for the batch parameter `{name}` ({other:?})"
                )));
            }
        };
    }
    Ok(query)
}

/// The same error for each caller of a failed batch (`sqlx::Error` is not `Clone`),
/// keeping what decides whether it is retryable and unreachable: the kind, and a
/// database error's SQLSTATE.
fn copy_error(e: &sqlx::Error) -> sqlx::Error {
    match e {
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        sqlx::Error::Tls(tls) => sqlx::Error::Tls(tls.to_string().into()),
        sqlx::Error::Database(db) => sqlx::Error::Database(Box::new(CopiedDbError::of(&**db))),
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
        sqlx::Error::WorkerCrashed => sqlx::Error::WorkerCrashed,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// A database error as another caller of the same batch sees it: its message, SQLSTATE
/// and kind.
#[derive(Debug)]
struct CopiedDbError {
    message: String,
    code: Option<String>,
    kind: sqlx::error::ErrorKind,
}

impl CopiedDbError {
    fn of(e: &dyn sqlx::error::DatabaseError) -> CopiedDbError {
        CopiedDbError {
            message: e.message().to_owned(),
            code: e.code().map(|c| c.into_owned()),
            kind: copy_kind(&e.kind()),
        }
    }
}

/// `ErrorKind` is not `Clone`.
fn copy_kind(kind: &sqlx::error::ErrorKind) -> sqlx::error::ErrorKind {
    use sqlx::error::ErrorKind;
    match kind {
        ErrorKind::UniqueViolation => ErrorKind::UniqueViolation,
        ErrorKind::ForeignKeyViolation => ErrorKind::ForeignKeyViolation,
        ErrorKind::NotNullViolation => ErrorKind::NotNullViolation,
        ErrorKind::CheckViolation => ErrorKind::CheckViolation,
        _ => ErrorKind::Other,
    }
}

impl std::fmt::Display for CopiedDbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CopiedDbError {}

impl sqlx::error::DatabaseError for CopiedDbError {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.code.as_deref().map(std::borrow::Cow::Borrowed)
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        copy_kind(&self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::engine::TableName;
    use crate::store::engine::values::Val;
    use crate::store::engine::{Dialect, OptionalSql, Sql};
    use crate::store::postgres::test_db::TestDb;
    use crate::store::postgres::{Pg, map_err};
    use crate::store::test_support::*;
    use crate::store::{Fence, Store, StoreError};

    /// A database error as the one raised on a batch's connection.
    fn db_error(code: &str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(CopiedDbError {
            message: format!("error {code}"),
            code: Some(code.to_owned()),
            kind: sqlx::error::ErrorKind::Other,
        }))
    }

    /// A batch of fresh claims of `n` keys, and where each caller's answer arrives.
    #[allow(clippy::type_complexity)]
    fn fresh_batch(
        n: usize,
    ) -> (
        Vec<Waiting>,
        Vec<tokio::sync::oneshot::Receiver<Result<Vec<Row>, sqlx::Error>>>,
    ) {
        (0..n)
            .map(|i| {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let op = Gathered::Fresh {
                    id: op(&format!("batch-{i}")),
                    fp: FP,
                    lease_ms: 60_000,
                };
                (Waiting { op, reply }, answer)
            })
            .unzip()
    }

    /// Each caller's error from a failed batch, as the store maps it.
    async fn failed(
        answers: Vec<tokio::sync::oneshot::Receiver<Result<Vec<Row>, sqlx::Error>>>,
    ) -> Vec<(Option<String>, StoreError)> {
        let mut out = Vec::new();
        for answer in answers {
            let e = answer
                .await
                .expect("every caller is answered")
                .expect_err("a caller of the failed batch got rows");
            let code = match &e {
                sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
                _ => None,
            };
            out.push((code, map_err(e)));
        }
        out
    }

    /// A connection-level failure of a batch (SQLSTATE classes 08 and 57P) is every
    /// caller's, unreachable and retryable as from its own statement; a refusal on a
    /// live connection is issued again call by call.
    #[tokio::test]
    async fn a_lost_connection_reaches_every_caller_of_a_batch_as_unreachable() {
        for code in ["57P01", "57P02", "57P03", "08006", "08003"] {
            let e = db_error(code);
            assert!(!refused(&e), "{code} was taken for a refusal");
            let (batch, answers) = fresh_batch(3);
            fail_all(batch, &e);
            for (got, e) in failed(answers).await {
                assert_eq!(got.as_deref(), Some(code));
                assert!(e.retryable && e.unreachable, "{code}: {e:?}");
                assert_eq!(
                    e.to_string(),
                    format!("error returned from database: error {code}")
                );
            }
        }
        for code in ["23505", "42P01", "25006", "53300"] {
            assert!(refused(&db_error(code)), "{code}");
        }
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!refused(&io));
        let (batch, answers) = fresh_batch(2);
        fail_all(batch, &io);
        for (_, e) in failed(answers).await {
            assert!(e.retryable && e.unreachable, "{e:?}");
        }
    }

    /// Runs the batch statement `name` over `ops` and returns its rows.
    async fn batch_rows(db: &TestDb, name: OptionalSql, ops: &[Gathered]) -> Vec<Row> {
        let table = TableName::parse(&db.table, true).unwrap();
        let stmt = Stmt::render::<Pg>(Pg::optional_sql(name).unwrap(), &table);
        let calls: Vec<_> = ops.iter().map(Gathered::args).collect();
        let query = bind_batch(&stmt, &calls).unwrap();
        let rows = query
            .fetch_all(&db.admin)
            .await
            .expect("the batch statement runs");
        rows.iter().map(|r| decode_row(r).unwrap()).collect()
    }

    /// Batches decide released records as the lone statements do: a record at the
    /// released epoch is fenced, and a claim acquires at once, resuming the steps, under
    /// `on_takeover = unknown` too.
    #[tokio::test]
    async fn batches_resume_released_steps() {
        let Some(db) = TestDb::new("batchsteps").await else {
            return;
        };
        let ids = [op("r-1"), op("r-2")];
        let mut released = Vec::new();
        for id in &ids {
            let epoch = epoch_of(claim(&db.store, id, FP, LEASE).await);
            let step = outcome("1");
            let fence = db.store.record_step(id, epoch, "charge", &step).await;
            assert_eq!(fence.unwrap(), Fence::Held);
            assert_eq!(db.store.release(id, epoch, DAY).await.unwrap(), Fence::Held);
            released.push(epoch);
        }
        let col = |row: &Row, name: &str| {
            row.0
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no `{name}` in {row:?}"))
        };
        let records: Vec<_> = ids
            .iter()
            .zip(&released)
            .map(|(id, &epoch)| Gathered::Record {
                id: id.clone(),
                epoch: i64::try_from(epoch).unwrap(),
                outcome: outcome("2"),
                retain: DAY,
                payload: String::new(),
            })
            .collect();
        let rows = batch_rows(&db, OptionalSql::RecordBatch, &records).await;
        assert_eq!(rows.len(), 2);
        for row in &rows {
            assert_eq!(col(row, "held"), Val::Int(0), "{row:?}");
        }
        let claims: Vec<_> = ids
            .iter()
            .map(|id| Gathered::Claim {
                id: id.clone(),
                fp: FP,
                lease_ms: 60_000,
                to_unknown: true,
            })
            .collect();
        let rows = batch_rows(&db, OptionalSql::ClaimBatch, &claims).await;
        assert_eq!(rows.len(), 2);
        for row in &rows {
            assert_eq!(col(row, "mine"), Val::Bool(true), "{row:?}");
            assert_eq!(col(row, "state"), Val::Int(0), "{row:?}");
            assert_eq!(col(row, "taken_over"), Val::Bool(false), "{row:?}");
            assert_eq!(col(row, "resume"), Val::Bool(true), "{row:?}");
        }
        for id in &ids {
            assert_eq!(db.store.steps(id).await.unwrap().len(), 1);
        }
        db.cleanup().await;
    }

    /// The same through a real batch: its statement ends its own session
    /// (`pg_terminate_backend`, SQLSTATE 57P01), and every caller gets that error, not
    /// a statement of its own on a new connection.
    #[tokio::test]
    async fn a_batch_whose_session_ends_fails_each_caller_as_unreachable() {
        let Some(db) = TestDb::new("batchlost").await else {
            return;
        };
        let table = TableName::parse(&db.table, true).unwrap();
        let r = |sql| Stmt::render::<Pg>(sql, &table);
        let optional = |name| r(Pg::optional_sql(name).unwrap());
        let pool = db.store.dialect.pool.clone();
        let group = Arc::new(PgGroup {
            owned: Some(Arc::new(Conns::new((*pool.connect_options()).clone(), 2))),
            pool,
            claim_fresh: optional(OptionalSql::ClaimFresh),
            claim: r(Pg::sql(Sql::Claim)),
            record: r(Pg::sql(Sql::Record)),
            claim_fresh_batch: Stmt::render::<Pg>(
                "SELECT pg_terminate_backend(pg_backend_pid()), \
                 cardinality(:scopes::text[])::int8 AS ord",
                &table,
            ),
            claim_batch: optional(OptionalSql::ClaimBatch),
            record_batch: optional(OptionalSql::RecordBatch),
            claims: [Gather::new(1), Gather::new(1)],
            fresh: Gather::new(1),
            records: Gather::new(1),
        });
        let (batch, answers) = fresh_batch(3);
        write_batch(group, batch).await;
        for (code, e) in failed(answers).await {
            assert_eq!(code.as_deref(), Some("57P01"), "{e}");
            assert!(e.retryable && e.unreachable, "{e:?}");
        }
        db.cleanup().await;
    }
}
