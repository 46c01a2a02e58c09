//! MySQL's and MariaDB's error numbers as idem reads them: which a retry can clear,
//! which say the server cannot be reached or is read-only, and the store error a driver
//! error becomes.

use sqlx::mysql::MySqlDatabaseError;

use crate::error::StoreError;
use crate::store::engine;

pub(super) const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
pub(super) const ER_LOCK_DEADLOCK: u16 = 1213;
pub(super) const ER_SP_DOES_NOT_EXIST: u16 = 1305;
/// "Too many connections": the server's `max_connections`.
pub(super) const ER_CON_COUNT_ERROR: u16 = 1040;
/// A user's `max_user_connections`.
pub(super) const ER_TOO_MANY_USER_CONNECTIONS: u16 = 1203;
/// "The server is running with the --<option> option so it cannot execute this
/// statement": a read-only server when the option is `--read-only` or
/// `--super-read-only`.
pub(super) const ER_OPTION_PREVENTS_STATEMENT: u16 = 1290;
/// "Cannot execute statement in a READ ONLY transaction".
pub(super) const ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: u16 = 1792;
/// "Running in read-only mode".
pub(super) const ER_READ_ONLY_MODE: u16 = 1836;

/// The server's error number, for a database error.
pub(super) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// Error numbers a retry can clear: lock-wait timeout, deadlock, too many connections,
/// a read-only server (a failover in progress: the retry may reach the new primary;
/// 1290 only for its read-only options, see [`read_only`]), and the server going away.
fn retryable_number(n: u16) -> bool {
    matches!(
        n,
        ER_LOCK_WAIT_TIMEOUT
            | ER_LOCK_DEADLOCK
            | ER_CON_COUNT_ERROR
            | ER_TOO_MANY_USER_CONNECTIONS
            | ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
            | ER_READ_ONLY_MODE
    ) || unreachable_number(n)
}

/// Whether a database error says the server is read-only. Error 1290 names the option
/// that prevents the statement; only `--read-only` and `--super-read-only` are that.
fn read_only(number: u16, message: &str) -> bool {
    match number {
        ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION | ER_READ_ONLY_MODE => true,
        ER_OPTION_PREVENTS_STATEMENT => {
            message.contains("read-only") || message.contains("read_only")
        }
        _ => false,
    }
}

/// Error numbers that mean the server cannot be reached: shutting down (1053), the
/// connection killed (1927), network read and write failures (1158-1161), and the
/// client's "can't connect", "server has gone away" and "lost connection" (2002, 2003,
/// 2006, 2013). Not contention, refusals, constraints, or a read-only server: that one
/// answered and holds the records, so `fail_open` running the body unprotected could
/// duplicate a call idem knows of.
fn unreachable_number(n: u16) -> bool {
    matches!(n, 1053 | 1927 | 1158..=1161 | 2002 | 2003 | 2006 | 2013)
}

/// A database error's message; empty for other errors.
fn database_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => db.message().to_owned(),
        _ => String::new(),
    }
}

/// Maps a driver error to a [`StoreError`], retryable when a retry can clear it.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    match error_number(&e) {
        Some(n) => {
            let retryable = retryable_number(n) || read_only(n, &database_message(&e));
            let mut err = StoreError::new(retryable, e);
            err.unreachable = unreachable_number(n);
            err
        }
        None => engine::map_sqlx(e, |_| false, |_| false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_is_retryable_and_only_lost_connections_are_unreachable() {
        for n in [ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, 1040, 1053, 2013] {
            assert!(retryable_number(n), "{n}");
        }
        for n in [ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT, 1040, 1062, 1406] {
            assert!(!unreachable_number(n), "{n}");
        }
        for n in [1053, 1927, 2006, 2013] {
            assert!(unreachable_number(n), "{n}");
        }
        // A duplicate key, data too long, a syntax error, a missing table: fail closed.
        for n in [1062, 1406, 1064, 1146] {
            assert!(!retryable_number(n), "{n}");
        }
    }

    #[test]
    fn a_read_only_server_is_retryable_but_answered() {
        let mariadb = "The MariaDB server is running with the --read-only option so it cannot \
                       execute this statement";
        let mysql = "The MySQL server is running with the --super-read-only option so it \
                     cannot execute this statement";
        assert!(read_only(ER_OPTION_PREVENTS_STATEMENT, mariadb));
        assert!(read_only(ER_OPTION_PREVENTS_STATEMENT, mysql));
        assert!(read_only(ER_READ_ONLY_MODE, "Running in read-only mode"));
        assert!(read_only(ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION, ""));
        // Another option preventing a statement is configuration, not a failover.
        let other = "The MariaDB server is running with the --secure-file-priv option so it \
                     cannot execute this statement";
        assert!(!read_only(ER_OPTION_PREVENTS_STATEMENT, other));
        assert!(!retryable_number(ER_OPTION_PREVENTS_STATEMENT));
        for n in [ER_OPTION_PREVENTS_STATEMENT, ER_READ_ONLY_MODE, 1792] {
            assert!(!unreachable_number(n), "{n}");
        }
    }
}
