//! How a MySQL statement file runs on the wire: MySQL has no `RETURNING` on an upsert,
//! so a file may hold several statements (run in order on one connection, in one round
//! trip on the pool as a [`Batch`]) or alternatives (tried one by one until one
//! matches); rows are decoded column by column; and a connection whose statement was
//! dropped unanswered is closed rather than reused ([`Answering`]).

use sqlx::Executor;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlRow};

use crate::store::engine::values::Val;
use crate::store::engine::{Arg, Row, Stmt, bind};

/// A pooled connection with a statement in flight, closed rather than returned to the
/// pool if dropped before [`answered`](Self::answered): sqlx's MySQL driver cannot
/// resume a connection whose query future was dropped unanswered (a later statement can
/// wait forever for a reply, or read the dropped one's), and idem drops its statements
/// on timeouts. Closing also makes the server roll back what the statement left open.
pub(super) struct Answering(Option<sqlx::pool::PoolConnection<sqlx::MySql>>);

impl Answering {
    pub(super) async fn acquire(pool: &MySqlPool) -> Result<Self, sqlx::Error> {
        Ok(Self(Some(pool.acquire().await?)))
    }

    pub(super) fn get(&mut self) -> &mut MySqlConnection {
        self.0.as_mut().expect("taken only on drop or answer")
    }

    /// The statement was answered: the connection goes back to the pool.
    pub(super) fn answered(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            // Out of the pool (which opens another in its place) and closed with the socket.
            drop(conn.detach());
        }
    }
}

/// A statement file's statements: split at each line-ending `;`.
pub(super) fn split(sql: &str) -> Vec<&str> {
    sql.split(";\n")
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

/// Each of `stmt`'s statements with the names its `?`s bind, in order (for the bench).
pub(crate) fn parts_with_params(stmt: &Stmt) -> Vec<(String, Vec<String>)> {
    let mut names = stmt.params.iter();
    split(&stmt.sql)
        .into_iter()
        .map(|part| {
            let n = part.matches('?').count();
            (part.to_owned(), names.by_ref().take(n).cloned().collect())
        })
        .collect()
}

/// A DDL script's statements, without those that are only comments. A `CREATE
/// PROCEDURE` is one statement up to the `END` that starts a line, its body's `;`s
/// included.
pub(super) fn split_script(sql: &str) -> Vec<&str> {
    let sql = sql.trim_end().trim_end_matches(';');
    let code = |part: &str| -> String {
        let lines = part.lines().map(str::trim);
        let code: Vec<&str> = lines
            .filter(|l| !l.is_empty() && !l.starts_with("--"))
            .collect();
        code.join(" ")
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < sql.len() {
        let rest = &sql[at..];
        let mut end = rest.find(";\n").unwrap_or(rest.len());
        if code(&rest[..end])
            .to_ascii_uppercase()
            .starts_with("CREATE PROCEDURE")
        {
            end = rest
                .find("\nEND;\n")
                .map_or(rest.len(), |e| e + "\nEND".len());
        }
        let part = rest[..end].trim();
        if !code(part).is_empty() {
            out.push(part);
        }
        at += (end + 2).min(rest.len());
    }
    out
}

/// The line between a statement file's alternatives: writes fenced on states that
/// exclude one another, so at most one can match.
const OR_ELSE: &str = "\n-- or else\n";

/// A file's alternatives, if it is one: run outside any transaction, one round trip
/// when the first matches (a release of a claim without steps, the common case).
pub(super) fn alternatives(sql: &str) -> Option<Vec<&str>> {
    sql.contains(OR_ELSE).then(|| {
        sql.split(OR_ELSE)
            .map(|p| p.trim().trim_end_matches(';').trim_end())
            .collect()
    })
}

/// Runs `alternatives` in order on `conn` until one matches; how many rows it matched,
/// as `held`. Each takes as many of `args` as it has `?`s.
pub(super) async fn first_match(
    conn: &mut MySqlConnection,
    alternatives: &[&str],
    args: Vec<Arg<'_>>,
) -> Result<Vec<Row>, sqlx::Error> {
    let mut args = args.into_iter();
    let mut held = 0;
    for alternative in alternatives {
        let n = alternative.matches('?').count();
        let query = bind(sqlx::query(alternative), args.by_ref().take(n).collect());
        let done = query.execute(&mut *conn).await?;
        held = i64::try_from(done.rows_affected()).unwrap_or(i64::MAX);
        if held > 0 {
            break;
        }
    }
    Ok(vec![Row(vec![("held".to_owned(), Val::Int(held))])])
}

/// Runs `parts` in order on `conn`, each taking as many of `args` as it has `?`s; the last
/// one's rows if it is a `SELECT`, else the rows they all matched, as `held`.
pub(super) async fn run(
    conn: &mut MySqlConnection,
    parts: &[&str],
    args: Vec<Arg<'_>>,
) -> Result<Vec<Row>, sqlx::Error> {
    let mut args = args.into_iter();
    let mut out = Vec::new();
    let mut held: i64 = 0;
    for part in parts {
        let n = part.matches('?').count();
        let query = bind(sqlx::query(part), args.by_ref().take(n).collect());
        out = if is_select(part) {
            let rows = query.fetch_all(&mut *conn).await?;
            rows.iter().map(decode).collect::<Result<_, _>>()?
        } else {
            let done = query.execute(&mut *conn).await?;
            let matched = i64::try_from(done.rows_affected()).unwrap_or(i64::MAX);
            held = held.saturating_add(matched);
            vec![Row(vec![("held".to_owned(), Val::Int(held))])]
        };
    }
    Ok(out)
}

/// A statement file's statements as one transaction in one round trip: `BEGIN`, each
/// statement with its arguments written in as literals, and `COMMIT`, sent together as
/// one multi-statement query (sqlx sets `CLIENT_MULTI_STATEMENTS`). The server runs
/// them in order and stops at the first that fails, leaving the transaction open for
/// [`rolled_back`] to end.
pub(super) struct Batch {
    sql: String,
    /// Whether the last statement is the only `SELECT`: its rows are the result, else
    /// the rows all of them matched, as `held`.
    reads: bool,
}

impl Batch {
    /// The batch of `parts` with `args`, each taking as many as it has `?`s; `None`
    /// where a `SELECT` other than the last one would mix its rows into the result, or
    /// where the values are large (a step's outcome near a raised cap), which written in
    /// hex could outgrow the server's `max_allowed_packet`: those go one by one.
    pub(super) fn new(parts: &[&str], args: &[Arg<'_>]) -> Option<Batch> {
        let (last, before) = parts.split_last()?;
        if before.iter().any(|p| is_select(p)) && is_select(last) {
            return None;
        }
        let size: usize = args
            .iter()
            .map(|a| match a {
                Arg::Text(s) | Arg::OptText(Some(s)) => s.len(),
                Arg::Bytes(b) => b.len(),
                _ => 0,
            })
            .sum();
        if size > BATCH_VALUES_MAX {
            return None;
        }
        let mut sql = String::from("BEGIN;\n");
        let mut args = args.iter();
        for part in parts {
            let mut pieces = part.split('?');
            sql.push_str(pieces.next().unwrap_or_default());
            for piece in pieces {
                literal(&mut sql, args.next()?);
                sql.push_str(piece);
            }
            sql.push_str(";\n");
        }
        sql.push_str("COMMIT");
        Some(Batch {
            sql,
            reads: is_select(last),
        })
    }

    pub(super) async fn run(&self, conn: &mut MySqlConnection) -> Result<Vec<Row>, sqlx::Error> {
        let query = sqlx::raw_sql(&self.sql);
        if self.reads {
            let rows = conn.fetch_all(query).await?;
            return rows.iter().map(decode).collect();
        }
        // The sum over the statements: `BEGIN`, `COMMIT` and a `SELECT` count none.
        let done = conn.execute(query).await?;
        let held = i64::try_from(done.rows_affected()).unwrap_or(i64::MAX);
        Ok(vec![Row(vec![("held".to_owned(), Val::Int(held))])])
    }
}

/// Writes `arg` into `sql` as a literal: numbers in decimal, bytes and text in hex (no
/// quoting or escaping to get wrong, whatever the SQL mode), text as `utf8mb4`.
fn literal(sql: &mut String, arg: &Arg<'_>) {
    use std::fmt::Write;
    let hex = |sql: &mut String, bytes: &[u8]| {
        sql.push_str("X'");
        for b in bytes {
            let _ = write!(sql, "{b:02X}");
        }
        sql.push('\'');
    };
    let text = |sql: &mut String, s: &str| {
        sql.push_str("CONVERT(");
        hex(sql, s.as_bytes());
        sql.push_str(" USING utf8mb4)");
    };
    match *arg {
        Arg::Text(s) | Arg::OptText(Some(s)) => text(sql, s),
        Arg::Bytes(b) => hex(sql, b),
        Arg::Int(n) | Arg::OptInt(Some(n)) => {
            let _ = write!(sql, "{n}");
        }
        Arg::Bool(b) => sql.push_str(if b { "TRUE" } else { "FALSE" }),
        Arg::OptText(None) | Arg::OptInt(None) => sql.push_str("NULL"),
    }
}

/// The bytes of values a [`Batch`] writes in, at most: a quarter of the smallest default
/// `max_allowed_packet` (4 MiB, MySQL 5.7), after hex doubles them.
const BATCH_VALUES_MAX: usize = 512 * 1024;

/// Ends what a failed [`Batch`] left open; whether `conn` can go back to the pool.
pub(super) async fn rolled_back(conn: &mut MySqlConnection) -> bool {
    conn.execute(sqlx::raw_sql("ROLLBACK")).await.is_ok()
}

/// Whether a statement answers with rows: a `SELECT`, or a `CALL` (the claim's
/// procedure, whose last statement is one).
fn is_select(sql: &str) -> bool {
    ["select", "call "].iter().any(|k| {
        sql.get(..k.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(k))
    })
}

/// A row as the engine reads it: integers of any width (and MySQL's booleans, which are
/// integers), binary strings as bytes, character strings as text.
fn decode(row: &MySqlRow) -> Result<Row, sqlx::Error> {
    use sqlx::{Column, Row as _, TypeInfo, ValueRef};
    let mut out = Vec::with_capacity(row.len());
    for (i, col) in row.columns().iter().enumerate() {
        let raw = row.try_get_raw(i)?;
        let kind = raw.type_info().name().to_owned();
        let val = if raw.is_null() {
            Val::Null
        } else if kind.contains("INT") || kind == "BOOLEAN" {
            match row.try_get::<i64, _>(i) {
                Ok(n) => Val::Int(n),
                Err(_) => match row.try_get::<u64, _>(i) {
                    Ok(n) => Val::Int(i64::try_from(n).unwrap_or(i64::MAX)),
                    Err(_) => Val::Bool(row.try_get(i)?),
                },
            }
        } else if kind.contains("BINARY") || kind.contains("BLOB") {
            Val::Bytes(row.try_get(i)?)
        } else {
            Val::Text(row.try_get(i)?)
        };
        out.push((col.name().to_owned(), val));
    }
    Ok(Row(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::engine::{Dialect, Sql, TableName};
    use crate::store::mysql::{MYSQL_SCHEMA_SQL, MySql};

    #[test]
    fn a_step_is_one_batch_with_its_arguments_written_in() {
        let table = TableName::parse("ops", false).unwrap().backticked();
        let step = Stmt::render::<MySql>(MySql::sql(Sql::RecordStep), &table);
        let named = [
            ("scope", Arg::Text("s'")),
            ("name", Arg::Text("n")),
            ("key", Arg::Text("k")),
            ("epoch", Arg::Int(-5)),
            ("label", Arg::Text("l")),
            ("outcome", Arg::Bytes(&[0xab; 32])),
            ("is_err", Arg::Bool(false)),
            ("version", Arg::Int(1)),
        ];
        let parts = split(&step.sql);
        assert_eq!(parts.len(), 4, "{}", step.sql);
        let args = step.args(&named).unwrap();
        let batch = Batch::new(&parts, &args).unwrap();
        // The last statement writes: the result is what they all matched.
        assert!(!batch.reads);
        assert!(batch.sql.starts_with("BEGIN;\n") && batch.sql.ends_with(";\nCOMMIT"));
        assert!(!batch.sql.contains('?'), "{}", batch.sql);
        // Every part between `BEGIN` and `COMMIT`, each one statement.
        assert_eq!(split(&batch.sql).len(), parts.len() + 2, "{}", batch.sql);
        let scope = "CONVERT(X'7327' USING utf8mb4)";
        assert!(batch.sql.contains(scope), "{}", batch.sql);
        assert!(batch.sql.contains(&format!("X'{}'", "AB".repeat(32))));
        assert!(batch.sql.contains("epoch = -5"), "{}", batch.sql);
        assert!(!batch.sql.contains("s'"), "never quoted: {}", batch.sql);
        // Too few arguments, or large values: not batched.
        assert!(Batch::new(&parts, &[]).is_none());
        let large = vec![0; BATCH_VALUES_MAX + 1];
        let named = [&named[..5], &[("outcome", Arg::Bytes(&large))], &named[6..]].concat();
        assert!(Batch::new(&parts, &step.args(&named).unwrap()).is_none());
        let mut sql = String::new();
        for arg in [
            Arg::OptText(None),
            Arg::OptInt(Some(3)),
            Arg::Bool(true),
            Arg::Bytes(&[]),
        ] {
            literal(&mut sql, &arg);
            sql.push(' ');
        }
        assert_eq!(sql, "NULL 3 TRUE X'' ");
    }

    #[test]
    fn statements_split_and_bind_by_occurrence() {
        let table = TableName::parse("ops", false).unwrap().backticked();
        let claim = Stmt::render::<MySql>(MySql::sql(Sql::Claim), &table);
        // One statement, the procedure's call, which answers with the decided row.
        let parts = split(&claim.sql);
        assert_eq!(parts.len(), 1, "{}", claim.sql);
        assert!(is_select(parts[0]));
        assert!(
            claim.sql.starts_with("CALL `ops_claim_v2`("),
            "{}",
            claim.sql
        );
        let named = [
            ("scope", Arg::Text("s")),
            ("name", Arg::Text("n")),
            ("key", Arg::Text("k")),
            ("fp", Arg::Bytes(&[0; 32])),
            ("token", Arg::Int(1)),
            ("lease_ms", Arg::Int(1)),
            ("to_unknown", Arg::Bool(false)),
        ];
        let args = claim.args(&named).unwrap();
        assert_eq!(args.len(), claim.sql.matches('?').count());
        let ddl = table.render_ddl(MYSQL_SCHEMA_SQL);
        let script = split_script(&ddl);
        assert_eq!(script.len(), 11, "{ddl}");
        // Each procedure is one statement, its body's `;`s included.
        for (procedure, name) in [(script[9], "`ops_claim`("), (script[10], "`ops_claim_v2`(")] {
            assert!(
                procedure.starts_with("--") && procedure.ends_with("\nEND"),
                "{procedure}"
            );
            assert!(procedure.contains(&format!("PROCEDURE IF NOT EXISTS {name}")));
            assert!(procedure.contains("INSERT INTO `ops_epoch_seq`"));
            assert!(procedure.contains("DELETE FROM `ops_epoch_seq`"));
            assert_eq!(procedure.matches("START TRANSACTION").count(), 1);
        }
        assert!(!ddl.contains("idem_operations"), "{ddl}");
        assert!(ddl.contains("TRIM(BOTH '`' FROM '`ops`')"), "{ddl}");
        assert!(
            ddl.contains("CREATE TABLE IF NOT EXISTS `ops_steps`"),
            "{ddl}"
        );
    }
}
