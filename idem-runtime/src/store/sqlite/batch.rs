//! Group commit on SQLite: it has one writer and every commit is an fsync, so
//! concurrent claims, records and other writes are gathered (one batch at a time) into
//! one transaction, each caller answered with its own rows; a lone write runs alone.
//! Claims of new keys, and records, go many callers' in one statement
//! (`claim_batch.sql`, `record_batch.sql`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sqlx::sqlite::{SqliteConnection, SqlitePool};
use tokio::sync::oneshot;

use crate::store::OperationId;
use crate::store::engine::values::decode_row;
use crate::store::engine::{Arg, Gathered, Row, Stmt, bind, claim_token};
use crate::store::group::Gather;

/// The writes of one SQLite store, gathered into shared transactions.
#[derive(Debug)]
pub(super) struct Writes {
    pool: SqlitePool,
    gather: Gather<Pending>,
    /// The statements gathered claims and records run; `None` on the dialect that only
    /// migrates, before the store's statements exist.
    sql: Option<Arc<BatchSql>>,
}

impl Writes {
    pub(super) fn new(pool: SqlitePool, sql: Option<BatchSql>) -> Writes {
        Writes {
            pool,
            gather: Gather::new(1),
            sql: sql.map(Arc::new),
        }
    }

    /// Whether claims and records go through [`write`](Self::write): on a store's
    /// dialect, always, as SQLite has one writer and every write waits for the batch
    /// before it anyway.
    pub(super) fn gathers(&self) -> bool {
        self.sql.is_some()
    }

    /// Queues one write for the next batch and waits for its rows.
    pub(super) async fn write(&self, work: Work) -> Result<Vec<Row>, sqlx::Error> {
        let (reply, answer) = oneshot::channel();
        let batch = |batch| write_batch(self.pool.clone(), self.sql.clone(), batch);
        self.gather
            .submit(Pending { work, reply }, answer, batch)
            .await
            .unwrap_or_else(|| Err(lost_batch()))
    }
}

/// What a batch runs for the claims and records in it.
#[derive(Debug)]
pub(super) struct BatchSql {
    /// A claim alone (`claim.sql`).
    pub(super) claim: Stmt,
    /// A record alone (`record.sql`).
    pub(super) record: Stmt,
    /// The claims of new keys, many callers' in one statement: each statement is a
    /// crossing to the connection's thread, which costs more than the row it writes.
    pub(super) claim_batch: Stmt,
    /// Records, many callers' in one statement.
    pub(super) record_batch: Stmt,
}

/// A write waiting for its batch.
#[derive(Debug)]
struct Pending {
    work: Work,
    reply: oneshot::Sender<Result<Vec<Row>, sqlx::Error>>,
}

/// What a waiting write runs.
#[derive(Debug)]
pub(super) enum Work {
    /// Any statement.
    Stmt {
        sql: String,
        /// Several statements ([`is_script`]): run alone, they take a transaction of
        /// their own.
        script: bool,
        args: Vec<OwnedArg>,
    },
    /// A claim or record, which a batch may run in one statement with others.
    Op(Gathered),
}

/// An [`Arg`] that outlives its caller's borrow, for a write run by another task.
#[derive(Debug)]
pub(super) enum OwnedArg {
    Text(String),
    OptText(Option<String>),
    Bytes(Vec<u8>),
    Int(i64),
    OptInt(Option<i64>),
    Bool(bool),
}

impl OwnedArg {
    pub(super) fn from(a: Arg<'_>) -> OwnedArg {
        match a {
            Arg::Text(t) => OwnedArg::Text(t.to_owned()),
            Arg::OptText(t) => OwnedArg::OptText(t.map(str::to_owned)),
            Arg::Bytes(b) => OwnedArg::Bytes(b.to_vec()),
            Arg::Int(i) => OwnedArg::Int(i),
            Arg::OptInt(i) => OwnedArg::OptInt(i),
            Arg::Bool(b) => OwnedArg::Bool(b),
        }
    }

    fn arg(&self) -> Arg<'_> {
        match self {
            OwnedArg::Text(t) => Arg::Text(t),
            OwnedArg::OptText(t) => Arg::OptText(t.as_deref()),
            OwnedArg::Bytes(b) => Arg::Bytes(b),
            OwnedArg::Int(i) => Arg::Int(*i),
            OwnedArg::OptInt(i) => Arg::OptInt(*i),
            OwnedArg::Bool(b) => Arg::Bool(*b),
        }
    }
}

impl Pending {
    async fn run<'c, E>(&self, on: E, sql: Option<&BatchSql>) -> Result<Vec<Row>, sqlx::Error>
    where
        E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
    {
        match (&self.work, sql) {
            (Work::Stmt { sql, args, .. }, _) => {
                rows(on, sql, args.iter().map(OwnedArg::arg).collect()).await
            }
            (Work::Op(op), Some(sql)) => run_op(on, sql, op).await,
            (Work::Op(_), None) => Err(sqlx::Error::Protocol(
                "a claim or record gathered before the store's statements exist".into(),
            )),
        }
    }

    /// Runs the write on its own: in a transaction if it is a script, so that its
    /// statements take effect together.
    async fn run_alone(
        &self,
        pool: &SqlitePool,
        sql: Option<&BatchSql>,
    ) -> Result<Vec<Row>, sqlx::Error> {
        if !matches!(self.work, Work::Stmt { script: true, .. }) {
            return self.run(pool, sql).await;
        }
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows = self.run(&mut *tx, sql).await?;
        tx.commit().await?;
        Ok(rows)
    }
}

/// Runs a claim's or record's own statement, as the engine would issue it.
async fn run_op<'c, E>(on: E, sql: &BatchSql, op: &Gathered) -> Result<Vec<Row>, sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
{
    let mut named = op.args();
    let stmt = match op {
        // SQLite has no `claim_fresh.sql`, so the engine sends none; no row would send
        // one on to the full claim, which decides every case.
        Gathered::Fresh { .. } => return Ok(Vec::new()),
        Gathered::Claim { .. } => {
            named.push(("token", Arg::Int(claim_token())));
            &sql.claim
        }
        Gathered::Record { .. } => &sql.record,
    };
    let args = stmt
        .args(&named)
        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    rows(on, &stmt.sql, args).await
}

/// Whether a statement file holds several statements, one per line-ending `;` (sqlx runs
/// them in order, binding each its numbered parameters, and returns every one's rows).
pub(super) fn is_script(sql: &str) -> bool {
    sql.contains(";\n")
}

/// Runs one statement on `on` and reads its rows.
pub(super) async fn rows<'c, E>(
    on: E,
    sql: &str,
    args: Vec<Arg<'_>>,
) -> Result<Vec<Row>, sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
{
    let rows = bind(sqlx::query(sql), args).fetch_all(on).await?;
    rows.iter().map(decode_row).collect()
}

fn lost_batch() -> sqlx::Error {
    sqlx::Error::Protocol(
        "a group-commit batch ended without answering (its write panicked)".into(),
    )
}

/// Writes `batch` in one transaction and answers each write. If any write or the commit
/// fails, the transaction is rolled back whole and every write runs again alone, so one
/// write's failure is its own and no write takes effect twice.
async fn write_batch(pool: SqlitePool, sql: Option<Arc<BatchSql>>, batch: Vec<Pending>) {
    let sql = sql.as_deref();
    if batch.len() > 1 {
        let together = async {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            let mut answers = in_one_statement(&mut tx, sql, &batch).await?;
            for (p, answer) in batch.iter().zip(&mut answers) {
                if answer.is_none() {
                    *answer = Some(p.run(&mut *tx, sql).await?);
                }
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(answers)
        };
        if let Ok(answers) = together.await {
            for (p, rows) in batch.into_iter().zip(answers) {
                let _ = p.reply.send(Ok(rows.unwrap_or_default()));
            }
            return;
        }
        // Dropping the transaction rolled it back: nothing of the batch took effect.
    }
    // A lone write, or a failed batch's writes, each alone.
    for p in batch {
        let r = p.run_alone(&pool, sql).await;
        let _ = p.reply.send(r);
    }
}

/// A batch's claims, and its records, each kind in one statement where it has two or
/// more with distinct keys (`claim_batch.sql`, `record_batch.sql`), before its other
/// writes: the rows of each write answered, `None` for each left to run on its own. A
/// claim whose key exists is left, for `claim.sql` to decide; a key's second claim or
/// record is left, as a statement changes a row once, and so is an operation whose
/// names hold a NUL. The writes of one batch are concurrent, so this order is as good
/// as their arrival's.
async fn in_one_statement(
    conn: &mut SqliteConnection,
    sql: Option<&BatchSql>,
    batch: &[Pending],
) -> Result<Vec<Option<Vec<Row>>>, sqlx::Error> {
    let mut answers: Vec<Option<Vec<Row>>> = batch.iter().map(|_| None).collect();
    let Some(sql) = sql else {
        return Ok(answers);
    };
    for records in [false, true] {
        let mut seen = HashSet::new();
        let picked: Vec<(usize, &Gathered)> = batch
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match &p.work {
                Work::Op(op) if matches!(op, Gathered::Record { .. }) == records => Some((i, op)),
                _ => None,
            })
            // Older SQLites' JSON functions (3.40, for one) cut a string at an escaped
            // NUL; the bundled one keeps it whole, but a build may link the system's.
            // So an operation named with a NUL runs its own statement.
            .filter(|(_, op)| {
                let id = op.id();
                ![&id.scope, &id.name, &id.key]
                    .iter()
                    .any(|s| s.contains('\0'))
            })
            .filter(|(_, op)| seen.insert(op.id()))
            .collect();
        if picked.len() < 2 {
            continue;
        }
        let (stmt, fields) = if records {
            (&sql.record_batch, RECORD_FIELDS)
        } else {
            (&sql.claim_batch, CLAIM_FIELDS)
        };
        let elements = picked
            .iter()
            .map(|(_, op)| json_element(&op.args(), fields))
            .collect::<Result<Vec<_>, _>>()?;
        let json = serde_json::Value::Array(elements).to_string();
        let mut by_id: HashMap<OperationId, Row> = HashMap::new();
        for row in rows(&mut *conn, &stmt.sql, vec![Arg::Text(&json)]).await? {
            by_id.insert(row_id(&row)?, row);
        }
        for (i, op) in picked {
            answers[i] = match (by_id.remove(op.id()), op) {
                (Some(row), _) => Some(vec![row]),
                // The fence did not hold, or (from the engine's plain insert) the key
                // exists: no row, as their own statements answer.
                (None, Gathered::Record { .. } | Gathered::Fresh { .. }) => Some(Vec::new()),
                (None, Gathered::Claim { .. }) => None,
            };
        }
    }
    Ok(answers)
}

/// The parameters of `claim.sql` that `claim_batch.sql` takes, in its array's order.
const CLAIM_FIELDS: &[&str] = &["scope", "name", "key", "fp", "lease_ms"];
/// The parameters of `record.sql` that `record_batch.sql` takes, in its array's order.
const RECORD_FIELDS: &[&str] = &[
    "scope",
    "name",
    "key",
    "epoch",
    "outcome",
    "is_err",
    "version",
    "retain_ms",
];

/// One write's element of a batch's JSON array: `fields` of its parameters, bytes in
/// hex (JSON has no bytes; the statement turns them back with `unhex`) and flags as
/// 0 or 1, as SQLite stores them.
fn json_element(
    named: &[(&'static str, Arg<'_>)],
    fields: &[&str],
) -> Result<serde_json::Value, sqlx::Error> {
    use serde_json::Value;
    let value = |field: &str| {
        let arg = named
            .iter()
            .find(|(n, _)| *n == field)
            .map(|&(_, a)| a)
            .ok_or_else(|| sqlx::Error::Protocol(format!("a batched write has no `{field}`")))?;
        Ok(match arg {
            Arg::Text(t) | Arg::OptText(Some(t)) => Value::from(t),
            Arg::Int(i) | Arg::OptInt(Some(i)) => Value::from(i),
            Arg::Bool(b) => Value::from(i64::from(b)),
            Arg::Bytes(b) => Value::from(crate::secret::hex(b)),
            Arg::OptText(None) | Arg::OptInt(None) => Value::Null,
        })
    };
    fields.iter().map(|f| value(f)).collect()
}

/// The operation a batch statement's row is of: its `scope`, `name` and `key`.
fn row_id(row: &Row) -> Result<OperationId, sqlx::Error> {
    let text = |name| {
        row.text(name)
            .map_err(|e| sqlx::Error::Protocol(e.to_string()))
    };
    Ok(OperationId {
        scope: text("scope")?,
        name: text("name")?,
        key: text("key")?,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::engine::SqlOptions;
    use crate::store::engine::values::Val;
    use crate::store::sqlite::tests::{TempDb, memory};
    use crate::store::sqlite::{SqliteStore, open};
    use crate::store::test_support::*;
    use crate::store::{Claim, Fence, Store};

    fn pending(op: Gathered) -> Pending {
        Pending {
            work: Work::Op(op),
            reply: oneshot::channel().0,
        }
    }

    fn claim_op(key: &str) -> Gathered {
        Gathered::Claim {
            id: op(key),
            fp: FP,
            lease_ms: 60_000,
            to_unknown: false,
        }
    }

    fn record_op(key: &str, epoch: u64, body: &str) -> Gathered {
        Gathered::Record {
            id: op(key),
            epoch: epoch as i64,
            outcome: outcome(body),
            retain: DAY,
            payload: String::new(),
        }
    }

    /// A store on a new file of its own, removed when the `TempDb` drops.
    async fn file_store(name: &str) -> (TempDb, SqliteStore) {
        let db = TempDb::new(name);
        let store = open(db.0.to_str().unwrap(), &SqlOptions::default())
            .await
            .unwrap();
        (db, store)
    }

    /// Runs `batch`'s one-statement writes in a transaction of their own and commits.
    async fn batched(store: &SqliteStore, batch: &[Pending]) -> Vec<Option<Vec<Row>>> {
        let mut tx = store.dialect.pool.begin().await.unwrap();
        let answers = in_one_statement(&mut tx, store.dialect.writes.sql.as_deref(), batch)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        answers
    }

    fn column(row: &Row, name: &str) -> Val {
        row.val(name).unwrap().clone()
    }

    /// A batch's claims of new keys and its records each run as one statement: every
    /// such write is answered by it, and what it cannot decide is left to its own
    /// statement.
    #[tokio::test]
    async fn a_batch_claims_new_keys_and_records_in_one_statement_each() {
        let (_db, store) = file_store("batch").await;
        let held = epoch_of(claim(&store, &op("held"), FP, LEASE).await);
        let taken = epoch_of(claim(&store, &op("taken"), FP, LEASE).await);
        let batch = [
            claim_op("a"),
            claim_op("b"),
            claim_op("a"),
            claim_op("taken"),
            record_op("held", held, "done"),
            record_op("taken", taken + 100, "not mine"),
            record_op("held", held, "again"),
        ]
        .map(pending);
        let answers = batched(&store, &batch).await;

        // New keys: claimed, each with an epoch of its own above those before.
        let mut epochs = Vec::new();
        for answer in &answers[..2] {
            let [row] = &answer.as_ref().expect("answered by the batch")[..] else {
                panic!("{answer:?}");
            };
            assert_eq!(column(row, "mine"), Val::Int(1));
            assert_eq!(column(row, "state"), Val::Int(0));
            let Val::Int(epoch) = column(row, "epoch") else {
                panic!("{row:?}");
            };
            epochs.push(epoch as u64);
        }
        assert!(
            epochs[0] != epochs[1] && epochs.iter().all(|&e| e > taken),
            "{epochs:?}"
        );
        // A key's second claim, and the claim of a key that exists: left to claim.sql.
        assert!(answers[2].is_none() && answers[3].is_none(), "{answers:?}");
        // Records: the fence held, the fence lost, and a key's second record left over.
        let [row] = &answers[4].as_ref().unwrap()[..] else {
            panic!("{answers:?}");
        };
        assert_eq!(column(row, "held"), Val::Int(1));
        assert_eq!(answers[5].as_deref().map(<[Row]>::len), Some(0));
        assert!(answers[6].is_none(), "{answers:?}");

        // What the statements wrote is what the store reads.
        match claim(&store, &op("held"), FP, LEASE).await {
            Claim::Completed(o) => assert_eq!(&o.body[..], b"done"),
            other => panic!("{other:?}"),
        }
        for (key, epoch) in [("a", epochs[0]), ("b", epochs[1])] {
            let fence = store.record(&op(key), epoch, &outcome(key), DAY).await;
            assert_eq!(fence.unwrap(), Fence::Held, "{key}");
        }
        let fence = store.record(&op("taken"), taken, &outcome("t"), DAY).await;
        assert_eq!(fence.unwrap(), Fence::Held);
    }

    /// A record batch finds each element's record by its key. The indexes on `state`
    /// tempt the planner into reading every record in a state for each element: a
    /// batch would cost a pass over the table.
    #[tokio::test]
    async fn a_record_batch_finds_each_record_by_its_key() {
        let store = memory().await;
        let stmt = &store.dialect.writes.sql.as_ref().unwrap().record_batch;
        let plan: Vec<String> = sqlx::query(&format!("EXPLAIN QUERY PLAN {}", stmt.sql))
            .bind("[]")
            .fetch_all(&store.dialect.pool)
            .await
            .unwrap()
            .iter()
            .map(|row| sqlx::Row::get(row, "detail"))
            .collect();
        let of_table: Vec<&String> = plan.iter().filter(|d| d.contains(" t ")).collect();
        assert!(!of_table.is_empty(), "{plan:?}");
        for detail in of_table {
            assert!(
                detail.starts_with("SEARCH") && detail.ends_with("(scope=? AND name=? AND key=?)"),
                "{plan:?}"
            );
        }
    }

    /// Keys JSON must escape go through a batch unchanged; a key with a NUL, which an
    /// older SQLite's JSON functions would cut short, is left to its own statement.
    #[tokio::test]
    async fn a_batch_keeps_every_key_as_it_is() {
        let (_db, store) = file_store("batch-keys").await;
        let keys = [
            "quote\"d",
            "back\\slash",
            "line\nbreak",
            "ключ 🔑",
            "bell\u{7}",
            "nul\0a",
        ];
        let mut batch: Vec<Pending> = keys.iter().map(|k| pending(claim_op(k))).collect();
        batch.push(pending(claim_op("nul\0b")));
        let answers = batched(&store, &batch).await;
        let mut epochs = Vec::new();
        for (key, answer) in keys[..5].iter().zip(&answers) {
            let [row] = &answer.as_ref().expect("answered by the batch")[..] else {
                panic!("{key:?}: {answer:?}");
            };
            assert_eq!(row_id(row).unwrap().key, *key);
            let Val::Int(epoch) = column(row, "epoch") else {
                panic!("{row:?}");
            };
            epochs.push(epoch as u64);
        }
        assert!(answers[5].is_none() && answers[6].is_none(), "{answers:?}");
        let records = keys[..5]
            .iter()
            .zip(&epochs)
            .map(|(key, &epoch)| pending(record_op(key, epoch, key)))
            .collect::<Vec<_>>();
        let answers = batched(&store, &records).await;
        for (key, answer) in keys.iter().zip(&answers) {
            assert_eq!(answer.as_ref().map(Vec::len), Some(1), "{key:?}");
            match claim(&store, &op(key), FP, LEASE).await {
                Claim::Completed(o) => assert_eq!(&o.body[..], key.as_bytes()),
                other => panic!("{key:?}: {other:?}"),
            }
        }
        // Nothing was written under the key a NUL would be cut to.
        for key in ["nul", "nul\0a", "nul\0b"] {
            let fresh = claim(&store, &op(key), FP, LEASE).await;
            assert!(
                matches!(fresh, Claim::Acquired { .. }),
                "{key:?}: {fresh:?}"
            );
        }
    }

    /// Many callers' fresh calls at once on a file: each claims with an epoch of its
    /// own, records its own outcome, and reads back its own.
    #[tokio::test]
    async fn concurrent_fresh_calls_each_keep_their_own() {
        let (_db, store) = file_store("gathered").await;
        let store = Arc::new(store);
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let (store, barrier) = (store.clone(), barrier.clone());
                tokio::spawn(async move {
                    let id = op(&format!("k{i}"));
                    barrier.wait().await;
                    let epoch = epoch_of(claim(&*store, &id, FP, LEASE).await);
                    let body = format!("outcome {i}");
                    let fence = store.record(&id, epoch, &outcome(&body), DAY).await;
                    assert_eq!(fence.unwrap(), Fence::Held);
                    match claim(&*store, &id, FP, LEASE).await {
                        Claim::Completed(o) => assert_eq!(&o.body[..], body.as_bytes()),
                        other => panic!("{other:?}"),
                    }
                    epoch
                })
            })
            .collect();
        let mut epochs = HashSet::new();
        for task in tasks {
            assert!(epochs.insert(task.await.unwrap()), "an epoch repeated");
        }
    }
}
