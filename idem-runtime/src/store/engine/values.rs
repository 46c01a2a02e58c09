//! What goes into a statement and what comes out of it: the values bound to named
//! parameters ([`Arg`]), the rows read back ([`Row`] of [`Val`]s), and the conversions
//! between SQL's integers and blobs and the store's durations, epochs and outcomes.

use std::time::Duration;

use crate::error::StoreError;
use crate::store::{OperationId, RecordDetail, RecordInfo, State, StoredOutcome};

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

    pub(crate) fn opt_int(&self, name: &str) -> Result<Option<i64>, StoreError> {
        match self.val(name)? {
            Val::Null => Ok(None),
            Val::Int(i) => Ok(Some(*i)),
            Val::Bool(b) => Ok(Some(i64::from(*b))),
            other => Err(corrupt(format!("`{name}` is {other:?}, not a number"))),
        }
    }

    pub(crate) fn int(&self, name: &str) -> Result<i64, StoreError> {
        self.opt_int(name)?
            .ok_or_else(|| corrupt(format!("`{name}` is NULL")))
    }

    /// A boolean, which SQLite stores as an integer.
    pub(crate) fn flag(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.int(name)? != 0)
    }

    pub(crate) fn text(&self, name: &str) -> Result<String, StoreError> {
        match self.val(name)? {
            Val::Text(t) => Ok(t.clone()),
            other => Err(corrupt(format!("`{name}` is {other:?}, not text"))),
        }
    }

    pub(crate) fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError> {
        match self.val(name)? {
            Val::Null => Ok(None),
            _ => self.text(name).map(Some),
        }
    }

    pub(crate) fn opt_bytes(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self.val(name)? {
            Val::Null => Ok(None),
            Val::Bytes(b) => Ok(Some(b.clone())),
            other => Err(corrupt(format!("`{name}` is {other:?}, not bytes"))),
        }
    }
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
#[allow(
    dead_code,
    reason = "for the dialects whose driver names each value's type; a build with only \
              MySQL has none"
)]
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

/// Durations are clamped to this many milliseconds (about 10,000 years) before they reach
/// SQL, so `now + retain` can overflow neither SQLite's integers nor PostgreSQL's
/// timestamps.
const MAX_DURATION_MS: i64 = 10_000 * 366 * 86_400 * 1000;

/// A duration as milliseconds for SQL, clamped to [`MAX_DURATION_MS`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(MAX_DURATION_MS, |ms| ms.min(MAX_DURATION_MS))
}

/// A lease as the milliseconds a statement writes: [`lease_written`](crate::store::lease_written),
/// so the store's millisecond clock never ends it early.
pub(crate) fn lease_millis(lease: Duration) -> i64 {
    millis(crate::store::lease_written(lease))
}

/// Milliseconds from SQL as a duration; negative (clock skew between statements) is zero.
pub(crate) fn duration_ms(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// An epoch from the caller as SQL's signed integer. An epoch no claim could have made
/// (over `i64::MAX`) matches no row, so callers treat `None` as a lost fence.
pub(crate) fn sql_epoch(epoch: u64) -> Option<i64> {
    i64::try_from(epoch).ok()
}

/// An epoch read back from SQL.
pub(crate) fn epoch_from_sql(epoch: i64) -> Result<u64, StoreError> {
    u64::try_from(epoch).map_err(|_| corrupt(format!("negative epoch {epoch}")))
}

/// An outcome read back from SQL; `None` columns on a COMPLETED row are corruption.
pub(crate) fn outcome_from_sql(
    body: Option<Vec<u8>>,
    is_err: bool,
    version: i64,
) -> Result<StoredOutcome, StoreError> {
    let body = body.ok_or_else(|| corrupt("a COMPLETED record has no outcome".to_owned()))?;
    let version = u32::try_from(version)
        .map_err(|_| corrupt(format!("outcome version {version} is out of range")))?;
    Ok(StoredOutcome {
        is_err,
        version,
        body: body.into(),
    })
}

/// A [`RecordDetail`] from a row's columns (times in ms by
/// the store's clock).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_detail(
    id: &OperationId,
    state: i64,
    epoch: i64,
    age_ms: i64,
    lease_ms: Option<i64>,
    expires_ms: Option<i64>,
    outcome: Option<Vec<u8>>,
    outcome_is_err: bool,
    outcome_version: i64,
) -> Result<RecordDetail, StoreError> {
    let state =
        State::from_code(state).ok_or_else(|| corrupt(format!("unknown state code {state}")))?;
    let completed = state == State::Completed;
    Ok(RecordDetail {
        info: RecordInfo {
            id: id.clone(),
            state,
            epoch: epoch_from_sql(epoch)?,
            age: duration_ms(age_ms),
        },
        lease_remaining: (state == State::InProgress).then(|| duration_ms(lease_ms.unwrap_or(0))),
        // An IN_PROGRESS record has an expiry only once released with its steps.
        expires_in: if completed {
            Some(expires_ms.map_or(Duration::MAX, duration_ms))
        } else {
            expires_ms
                .filter(|_| state == State::InProgress)
                .map(duration_ms)
        },
        outcome: if completed {
            Some(outcome_from_sql(outcome, outcome_is_err, outcome_version)?)
        } else {
            None
        },
        steps: Vec::new(),
    })
}

/// A record that breaks the table's invariants: someone wrote it by hand, or a newer idem
/// with another schema did. Not retryable.
pub(crate) fn corrupt(what: String) -> StoreError {
    StoreError::new(
        false,
        format!(
            "the idem table holds an invalid record ({what}); was it written by hand or by \
             another idem version?"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_clamped() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS);
        assert_eq!(duration_ms(-5), Duration::ZERO);
        assert_eq!(sql_epoch(u64::MAX), None);
    }
}
