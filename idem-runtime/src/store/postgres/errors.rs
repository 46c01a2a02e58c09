//! PostgreSQL's SQLSTATEs as idem reads them: which a retry can clear, which say the
//! server cannot be reached, and the store error a driver error becomes.

use crate::error::StoreError;
use crate::store::engine;

/// SQLSTATE `too_many_connections`: no slot left on the server, for the database or
/// for the role.
pub(super) const TOO_MANY_CONNECTIONS: &str = "53300";

/// `read_only_sql_transaction`: "cannot execute … in a read-only transaction" (a
/// standby, a primary being demoted in a failover, `default_transaction_read_only`) and
/// "cannot execute … during recovery".
pub(super) const READ_ONLY_TRANSACTION: &str = "25006";

/// SQLSTATEs a retry can clear: serialization failure, deadlock, lock timeout, statement
/// timeout, server shutting down or starting, too many connections, the connection
/// exception class, and a read-only server (a failover in progress: the retry may reach
/// the new primary).
fn retryable_code(code: &str) -> bool {
    matches!(
        code,
        "40001"
            | "40P01"
            | "55P03"
            | "57014"
            | "57P01"
            | "57P02"
            | "57P03"
            | TOO_MANY_CONNECTIONS
            | READ_ONLY_TRANSACTION
    ) || code.starts_with("08")
}

/// SQLSTATEs that mean the server cannot be reached: the connection exception class and
/// a server shutting down, crashed or starting. Not contention, refusals, conflicts, or
/// a read-only server: that one answered and holds the records (a running call's claim
/// among them), so `fail_open` running the body unprotected could duplicate a call idem
/// knows of, where a retry after the failover succeeds.
pub(super) fn unreachable_code(code: &str) -> bool {
    code.starts_with("08") || code.starts_with("57P")
}

/// Maps a driver error to a [`StoreError`], retryable when a retry can clear it.
pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    engine::map_sqlx(e, retryable_code, unreachable_code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_sqlstates_are_retryable() {
        for code in [
            "40001", "40P01", "55P03", "08006", "57P01", "53300", "25006",
        ] {
            assert!(retryable_code(code), "{code}");
        }
        for code in ["23505", "42P01", "42601", "22P02"] {
            assert!(!retryable_code(code), "{code}");
        }
        // Answered, if with a refusal: `fail_open` must not run the body on these.
        for code in ["25006", "53300", "40001", "55P03"] {
            assert!(!unreachable_code(code), "{code}");
        }
    }
}
