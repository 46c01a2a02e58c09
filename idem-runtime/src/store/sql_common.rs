//! What the SQL stores share: options, validated table names, the shipped DDL, the
//! claim decision table, and error mapping.

use std::time::Duration;

use crate::error::{IdemError, StoreError};
use crate::store::{Claim, StoredOutcome};

use crate::secret::PLAIN_KEYS;

/// Fails unless the table's recorded key mode is the one this store was opened with:
/// opening it in the other mode would silently give every operation a new identity.
pub(crate) fn check_key_mode(
    table: &TableName,
    recorded: Option<String>,
    wanted: &str,
) -> Result<(), IdemError> {
    crate::secret::check_key_mode(
        &format!("the idem table `{table}`"),
        "another table",
        recorded.as_deref(),
        wanted,
    )
}

/// The table name the shipped DDL uses.
pub(crate) const DEFAULT_TABLE: &str = "idem_operations";

/// Suffixes of the objects in the shipped DDL that live beside the table unqualified
/// (indexes, triggers); every other `idem_operations_*` name (the meta table, the epoch
/// sequence, the steps table) is a relation in the table's schema. All are renamed with
/// the table so two idem tables can share a schema.
const DDL_UNQUALIFIED: [&str; 4] = ["_idx", "_ins", "_upd", "_del"];

/// PostgreSQL's identifier limit (longer names are silently truncated, which could make
/// two index names collide).
const MAX_IDENT: usize = 63;

/// Durations are clamped to this many milliseconds (about 10,000 years) before they reach
/// SQL, so `now + retain` can overflow neither SQLite's integers nor PostgreSQL's
/// timestamps.
const MAX_DURATION_MS: i64 = 10_000 * 366 * 86_400 * 1000;

/// How the SQL stores are set up: which table, and whether idem creates it.
#[derive(Clone, Debug)]
pub(crate) struct SqlOptions {
    /// The operations table: `[A-Za-z_][A-Za-z0-9_]*`, at most 63 characters; on
    /// PostgreSQL optionally `schema.table`.
    pub table: String,
    /// Whether to create or upgrade the table on open. With `false`, the table must exist
    /// (see [`schema`](crate::schema)).
    pub migrate: bool,
    /// The size of the pool idem opens itself (not used with `from_pool`).
    pub max_connections: Option<u32>,
    /// Whether concurrent claims and records share statements (PostgreSQL).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub group_commit: bool,
    /// How keys and scopes are stored (`plain`, or `hmac-sha256:` and a check value of
    /// the secret), recorded in the table at first open and required to match after.
    pub key_mode: String,
    /// A PEM CA the server's certificate may chain to (PostgreSQL, MySQL).
    #[cfg_attr(not(feature = "_sql_server"), allow(dead_code))]
    pub root_cert: Option<Vec<u8>>,
}

impl Default for SqlOptions {
    fn default() -> Self {
        SqlOptions {
            table: DEFAULT_TABLE.to_owned(),
            migrate: true,
            max_connections: None,
            group_commit: true,
            key_mode: PLAIN_KEYS.to_owned(),
            root_cert: None,
        }
    }
}

/// A validated table name, optionally schema-qualified (PostgreSQL only).
///
/// Only plain identifiers are accepted, so interpolating the name into SQL is safe; it is
/// still double-quoted there so reserved words (`order`, `user`) work as table names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: Option<String>,
    table: String,
    /// The identifier quote: `"` (standard SQL), or MySQL's backtick.
    quote: char,
}

impl TableName {
    /// Validates `name`; `schema.table` only when `allow_schema` (PostgreSQL).
    pub(crate) fn parse(name: &str, allow_schema: bool) -> Result<TableName, IdemError> {
        let (schema, table) = match name.split_once('.') {
            Some((schema, table)) if allow_schema => (Some(schema), table),
            Some(_) => {
                return Err(IdemError::Config {
                    message: format!(
                        "table name `{name}` is schema-qualified, which SQLite does not support; \
                         use a plain name matching `[A-Za-z_][A-Za-z0-9_]*` (at most {MAX_IDENT} \
                         characters)"
                    ),
                });
            }
            None => (None, name),
        };
        for part in schema.iter().chain([&table]) {
            if !is_identifier(part) {
                let allowed = if allow_schema {
                    "`table` or `schema.table`, each part matching `[A-Za-z_][A-Za-z0-9_]*`"
                } else {
                    "a name matching `[A-Za-z_][A-Za-z0-9_]*`"
                };
                return Err(IdemError::Config {
                    message: format!(
                        "invalid table name `{name}`; use {allowed}, at most {MAX_IDENT} characters"
                    ),
                });
            }
        }
        Ok(TableName {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
            quote: '"',
        })
    }

    /// The same name, quoted with backticks as MySQL does without `ANSI_QUOTES`.
    #[cfg(feature = "mysql")]
    pub(crate) fn backticked(self) -> TableName {
        TableName { quote: '`', ..self }
    }

    /// The schema, if the name was qualified.
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table name without its schema.
    pub(crate) fn bare(&self) -> &str {
        &self.table
    }

    /// The name as SQL: `"schema"."table"` or `"table"`.
    pub(crate) fn qualified(&self) -> String {
        self.sibling(&self.table)
    }

    /// Another relation in the same schema, as SQL (idem's bookkeeping table).
    pub(crate) fn sibling(&self, name: &str) -> String {
        let q = self.quote;
        match &self.schema {
            Some(schema) => format!("{q}{schema}{q}.{q}{name}{q}"),
            None => format!("{q}{name}{q}"),
        }
    }

    /// The name of one of this table's indexes, as SQL (unqualified: an index lives in
    /// its table's schema). Cut to fit PostgreSQL's limit without losing the suffix.
    fn index(&self, suffix: &str) -> String {
        format!("{q}{}{q}", self.suffixed(suffix), q = self.quote)
    }

    /// The table's name with `suffix`, cut to fit PostgreSQL's limit without losing it.
    fn suffixed(&self, suffix: &str) -> String {
        let keep = MAX_IDENT.saturating_sub(suffix.len()).min(self.table.len());
        format!("{}{suffix}", &self.table[..keep])
    }

    /// A relation of this table's own (`_meta`, `_epoch_seq`, `_steps`), as SQL, in its
    /// schema.
    pub(crate) fn companion(&self, suffix: &str) -> String {
        self.sibling(&self.suffixed(suffix))
    }

    /// The shipped DDL, renamed for this table: whole identifiers only, in one pass, so
    /// the table's name never rewrites inside an index name (or a longer identifier).
    pub(crate) fn render_ddl(&self, ddl: &str) -> String {
        let mut out = String::with_capacity(ddl.len() + 64);
        let mut rest = ddl;
        while let Some(start) = rest.find(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            let (before, from) = rest.split_at(start);
            out.push_str(before);
            let end = from
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(from.len());
            let (word, after) = from.split_at(end);
            if word == DEFAULT_TABLE {
                out.push_str(&self.qualified());
            } else if let Some(suffix) = word
                .strip_prefix(DEFAULT_TABLE)
                .filter(|s| s.starts_with('_'))
            {
                if DDL_UNQUALIFIED.iter().any(|u| suffix.ends_with(u)) {
                    out.push_str(&self.index(suffix));
                } else {
                    out.push_str(&self.companion(suffix));
                }
            } else {
                out.push_str(word);
            }
            rest = after;
        }
        out.push_str(rest);
        out
    }

    /// A statement template with `{table}`, `{meta}`, `{epoch_seq}`, `{steps}` (the
    /// steps table) and `{now}` filled in.
    pub(crate) fn render(&self, template: &str, now: &str) -> String {
        template
            .replace("{table}", &self.qualified())
            .replace("{meta}", &self.companion("_meta"))
            .replace("{epoch_seq}", &self.companion("_epoch_seq"))
            .replace("{steps}", &self.companion("_steps"))
            .replace("{bookkeeping}", &self.sibling("idem_schema_migrations"))
            // MySQL's claim, a stored procedure named after the table.
            .replace("{claim_procedure}", &self.companion("_claim_v2"))
            .replace("{now}", now)
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.table),
            None => f.write_str(&self.table),
        }
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.len() <= MAX_IDENT
}

/// A duration as milliseconds for SQL, clamped to [`MAX_DURATION_MS`].
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(MAX_DURATION_MS, |ms| ms.min(MAX_DURATION_MS))
}

/// A lease as the milliseconds a statement writes: [`lease_written`](super::lease_written),
/// so the store's millisecond clock never ends it early.
pub(crate) fn lease_millis(lease: Duration) -> i64 {
    millis(super::lease_written(lease))
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

/// A [`RecordDetail`](crate::store::RecordDetail) from a row's columns (times in ms by
/// the store's clock).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_detail(
    id: &crate::store::OperationId,
    state: i64,
    epoch: i64,
    age_ms: i64,
    lease_ms: Option<i64>,
    expires_ms: Option<i64>,
    outcome: Option<Vec<u8>>,
    outcome_is_err: bool,
    outcome_version: i64,
) -> Result<crate::store::RecordDetail, StoreError> {
    use crate::store::State;
    let state =
        State::from_code(state).ok_or_else(|| corrupt(format!("unknown state code {state}")))?;
    let completed = state == State::Completed;
    Ok(crate::store::RecordDetail {
        info: crate::store::RecordInfo {
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

/// The row a claim statement returns, in backend-neutral form.
///
/// Both backends return the record as it stands after the statement, plus `mine` (this
/// statement claimed it, or moved it to UNKNOWN) and `stale` (the row, as read, is
/// claimable: PostgreSQL's fallback read saw an older version than the upsert did).
#[derive(Debug)]
pub(crate) struct ClaimRow {
    /// This statement wrote the row (fresh claim, takeover, or lapse to UNKNOWN).
    pub(crate) mine: bool,
    /// The row as read is claimable by this request; only possible when it was read from
    /// an older snapshot than the one the upsert judged.
    pub(crate) stale: bool,
    /// The state code.
    pub(crate) state: i64,
    /// The epoch.
    pub(crate) epoch: i64,
    /// The stored fingerprint equals the request's.
    pub(crate) same_fingerprint: bool,
    /// The current epoch was claimed by taking over a lapsed lease.
    pub(crate) taken_over: bool,
    /// The record has steps of its current life: a claim that acquired it resumes them.
    pub(crate) resume: bool,
    /// Remaining lease by the store's clock (meaningful for a live IN_PROGRESS row).
    pub(crate) retry_after_ms: i64,
    /// The outcome columns, read when the row is COMPLETED.
    pub(crate) outcome: Option<Vec<u8>>,
    /// Whether the outcome is an `Err`.
    pub(crate) outcome_is_err: bool,
    /// The outcome's version.
    pub(crate) outcome_version: i64,
}

/// What a claim row means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The claim is decided.
    Claim(Claim),
    /// The row was read from a snapshot older than the upsert's: issue the statement again.
    Reissue,
}

/// The claim decision table, applied to the row the statement returned.
///
/// | mine | state       | fingerprint | result                                   |
/// |------|-------------|-------------|------------------------------------------|
/// | yes  | IN_PROGRESS | (is ours)   | `Acquired { epoch, takeover, resume }`   |
/// | yes  | UNKNOWN     | (is ours)   | `Unknown { now: true }` (lapse→UNKNOWN)  |
/// | no   | (stale)     | —           | issue again                              |
/// | no   | any         | differs     | `Mismatch`                               |
/// | no   | COMPLETED   | equal       | `Completed(outcome)`                     |
/// | no   | IN_PROGRESS | equal       | `InFlight { retry_after }`               |
/// | no   | UNKNOWN     | equal       | `Unknown { now: false }`                 |
///
/// A row that is not ours is never claimable (the statement would have claimed it), so
/// "not ours" means the record is live: an unexpired COMPLETED, a live lease, or UNKNOWN.
pub(crate) fn decide(row: ClaimRow) -> Result<Decision, StoreError> {
    let epoch = epoch_from_sql(row.epoch)?;
    let state = crate::store::State::from_code(row.state)
        .ok_or_else(|| corrupt(format!("unknown state code {}", row.state)))?;
    use crate::store::State;
    let claim = match (row.mine, state) {
        (true, State::InProgress) => Claim::Acquired {
            epoch,
            takeover: row.taken_over,
            resume: row.resume,
        },
        (true, State::Unknown) => Claim::Unknown { epoch, now: true },
        (true, State::Completed) => {
            return Err(corrupt(
                "the claim statement left a COMPLETED row".to_owned(),
            ));
        }
        (false, _) if row.stale => return Ok(Decision::Reissue),
        (false, _) if !row.same_fingerprint => Claim::Mismatch,
        (false, State::Completed) => Claim::Completed(outcome_from_sql(
            row.outcome,
            row.outcome_is_err,
            row.outcome_version,
        )?),
        (false, State::InProgress) => Claim::InFlight {
            retry_after: duration_ms(row.retry_after_ms),
        },
        (false, State::Unknown) => Claim::Unknown { epoch, now: false },
    };
    Ok(Decision::Claim(claim))
}

/// What a claim inside the caller's transaction decided (transactional mode: no lease,
/// no epochs to fence on; the row lock is the claim and rollback is the release).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TxClaim {
    /// This transaction holds the claim at `epoch`: run the body, then `tx_record_*`.
    Acquired {
        /// The claim's epoch (what `current().epoch()` shows in the body).
        epoch: u64,
    },
    /// The operation completed (committed by another transaction): replay this.
    Completed(StoredOutcome),
    /// The key is bound to another fingerprint.
    Mismatch,
    /// The operation is UNKNOWN (moved there outside transactional mode).
    Unknown {
        /// The epoch whose effect is unknown.
        epoch: u64,
    },
    /// The record is IN_PROGRESS and visible: this same transaction claimed it already,
    /// or a claim made outside transactional mode holds it.
    InFlight {
        /// The remaining lease by the store's clock (zero for a transactional claim).
        retry_after: Duration,
    },
}

/// The row transactional mode's read returns, in backend-neutral form.
#[derive(Debug)]
pub(crate) struct TxRow {
    /// The stored fingerprint equals the request's.
    pub(crate) same_fingerprint: bool,
    /// COMPLETED and past its retention: it counts as absent.
    pub(crate) expired: bool,
    /// IN_PROGRESS and its lease lapsed: its owner is gone (a cancelled transactional
    /// body whose transaction committed anyway, or a crashed leased caller).
    pub(crate) lapsed: bool,
    /// The state code.
    pub(crate) state: i64,
    /// The epoch.
    pub(crate) epoch: i64,
    /// Remaining lease by the store's clock.
    pub(crate) retry_after_ms: i64,
    /// The outcome columns, read when the row is COMPLETED.
    pub(crate) outcome: Option<Vec<u8>>,
    /// Whether the outcome is an `Err`.
    pub(crate) outcome_is_err: bool,
    /// The outcome's version.
    pub(crate) outcome_version: i64,
}

/// The statements of a transactional claim, each over (scope, name, key, fingerprint),
/// as one backend runs them on the caller's connection.
pub(crate) trait TxSteps {
    /// The insert of a fresh claim: its epoch, if it inserted.
    async fn insert(&mut self) -> Result<Option<i64>, StoreError>;
    /// The existing row, if any.
    async fn read(&mut self) -> Result<Option<TxRow>, StoreError>;
    /// A fresh claim over an expired COMPLETED row: its epoch, if it took it.
    async fn reclaim_expired(&mut self) -> Result<Option<i64>, StoreError>;
    /// A takeover of a lapsed IN_PROGRESS row of the same fingerprint: its epoch, if it
    /// took it.
    async fn take_over(&mut self) -> Result<Option<i64>, StoreError>;
}

/// How often a transactional claim retries when the row it conflicted with vanished
/// (or expired) before it could be read.
const TX_ATTEMPTS: usize = 5;

/// Transactional mode's claim, the same for both backends: insert, else read the row the
/// insert conflicted with (committed by now: the insert waited on its lock), and decide.
pub(crate) async fn tx_claim(steps: &mut impl TxSteps) -> Result<TxClaim, StoreError> {
    let acquired = |epoch| {
        Ok::<_, StoreError>(TxClaim::Acquired {
            epoch: epoch_from_sql(epoch)?,
        })
    };
    for _ in 0..TX_ATTEMPTS {
        if let Some(epoch) = steps.insert().await? {
            return acquired(epoch);
        }
        let Some(row) = steps.read().await? else {
            continue; // deleted since the insert saw it: try the insert again
        };
        if row.expired {
            match steps.reclaim_expired().await? {
                Some(epoch) => return acquired(epoch),
                None => continue,
            }
        }
        // The two modes agree: a claim whose owner is gone is taken over after its
        // lease, whichever mode made it, so no key stays blocked.
        if row.lapsed && row.same_fingerprint {
            match steps.take_over().await? {
                Some(epoch) => return acquired(epoch),
                None => continue,
            }
        }
        return decide_tx(row);
    }
    Err(StoreError::new(
        true,
        "the idem record kept changing under the transactional claim; retry the transaction",
    ))
}

fn decide_tx(row: TxRow) -> Result<TxClaim, StoreError> {
    use crate::store::State;
    if !row.same_fingerprint {
        return Ok(TxClaim::Mismatch);
    }
    match State::from_code(row.state) {
        Some(State::Completed) => Ok(TxClaim::Completed(outcome_from_sql(
            row.outcome,
            row.outcome_is_err,
            row.outcome_version,
        )?)),
        Some(State::InProgress) => Ok(TxClaim::InFlight {
            retry_after: duration_ms(row.retry_after_ms),
        }),
        Some(State::Unknown) => Ok(TxClaim::Unknown {
            epoch: epoch_from_sql(row.epoch)?,
        }),
        None => Err(corrupt(format!("unknown state code {}", row.state))),
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
#[cfg(any(feature = "sqlite", feature = "mysql"))]
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

/// How long opening a server store waits for its first connection: sqlx's default
/// acquire timeout, which bounded the open before.
#[cfg(feature = "_sql_server")]
const FIRST_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a server store connects, and how its errors read, for [`first_connection`].
#[cfg(feature = "_sql_server")]
pub(crate) struct Server<'a> {
    /// The database's name in messages: `PostgreSQL`, `MySQL`.
    pub(crate) db: &'static str,
    /// The URL with its password redacted.
    pub(crate) shown: &'a str,
    /// `host:port`, or the Unix socket's path.
    pub(crate) at: String,
    /// The dialect's error mapping.
    pub(crate) map_err: fn(sqlx::Error) -> StoreError,
    /// Whether an error says the server has no connection slot left (PostgreSQL's
    /// SQLSTATE 53300, MySQL's 1040).
    pub(crate) is_full: fn(&sqlx::Error) -> bool,
    /// The connections idem holds to the server, at most, for messages.
    pub(crate) footprint: String,
    /// The URL parameters that ask for TLS and name the server's CA (`sslmode` and
    /// `sslrootcert` on PostgreSQL), for messages.
    pub(crate) tls_params: (&'static str, &'static str),
}

/// Opens one connection to the server, once, and says why it failed. A sqlx pool
/// retries a refused connection, and a server with no connection slot left, until its
/// acquire timeout and then reports only that it timed out; opening with one
/// connection first reports the cause at once, with the connections idem would hold.
#[cfg(feature = "_sql_server")]
pub(crate) async fn first_connection<O: sqlx::ConnectOptions>(
    server: &Server<'_>,
    options: &O,
) -> Result<O::Connection, IdemError>
where
    O::Connection: Sized,
{
    let Server {
        db,
        shown,
        at,
        map_err,
        is_full,
        footprint,
        tls_params,
    } = server;
    let (cause, retryable, unreachable) =
        match tokio::time::timeout(FIRST_CONNECTION_TIMEOUT, options.connect()).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(sqlx::Error::Io(e))) if e.kind() == std::io::ErrorKind::ConnectionRefused => (
                format!(
                    "connection refused at {at}: nothing listens there; check the server is up \
                     and the URL's host and port"
                ),
                true,
                true,
            ),
            Ok(Err(sqlx::Error::Tls(e))) => (tls_failure(*tls_params, &*e), false, false),
            // A handshake the TLS library refused (an untrusted certificate, another
            // host's name) reaches sqlx as an I/O error carrying the TLS error.
            Ok(Err(sqlx::Error::Io(e)))
                if e.kind() == std::io::ErrorKind::InvalidData && e.get_ref().is_some() =>
            {
                (tls_failure(*tls_params, &e), false, false)
            }
            Ok(Err(e)) if is_full(&e) => {
                let e = map_err(e);
                let cause = format!(
                    "the server has no connection slot left (too many connections: {}); \
                     {footprint}: free slots on the server (raise its `max_connections`, or \
                     close idle sessions), or lower idem's with `IdemBuilder::max_connections`",
                    e.source
                );
                (cause, e.retryable, e.unreachable)
            }
            Ok(Err(e)) => {
                let e = map_err(e);
                let cause = format!(
                    "{}; check the server is up and the URL's host, port, user and database",
                    e.source
                );
                (cause, e.retryable, e.unreachable)
            }
            Err(_) => (
                format!(
                    "no connection to {at} within {}s; check the URL's host and port, and that \
                     no firewall drops the traffic",
                    FIRST_CONNECTION_TIMEOUT.as_secs()
                ),
                true,
                true,
            ),
        };
    let mut err = StoreError::new(
        retryable,
        format!("cannot connect to {db} at `{shown}`: {cause}"),
    );
    err.unreachable = unreachable;
    Err(IdemError::store("connecting", err))
}

/// Why a TLS handshake failed, and what to change: the feature that brings TLS, or the
/// URL parameter (`ca` of the server's `(mode, ca)`) that names the server's CA.
#[cfg(feature = "_sql_server")]
fn tls_failure((mode, ca): (&str, &str), e: &(dyn std::error::Error + Send + Sync)) -> String {
    let text = e.to_string();
    if text.contains("without TLS support") {
        return format!(
            "the URL asks for TLS ({mode}) and idem-runtime was built without it: enable its \
             `tls-rustls` (or `tls-native-tls`) feature"
        );
    }
    format!(
        "the TLS handshake failed: {text}; check that the server's certificate is signed by \
         a CA this process trusts (name the server's CA file with `{ca}=` in the URL) and \
         that it names the host the URL gives, or lower `{mode}` only if you accept an \
         unverified server"
    )
}

/// A database URL as messages show it: the password, and the value of every query
/// parameter that may hold a secret, replaced by `***`.
///
/// Read as the driver reads it where it parses. A password with an unencoded `/`, `?`
/// or `#` makes the parser end the user info early (or fail), so where the URL does not
/// parse, or leaves an `@` outside the user info, everything from `://` to the last `@`
/// is taken for the user info: a message may then show less than it could, never a
/// password.
#[cfg(feature = "_sql_server")]
pub(crate) fn redact_url(url: &str) -> String {
    let shown = redact_parsed(url).unwrap_or_else(|| redact_user_info(url));
    redact_query(&shown)
}

/// The URL with its password redacted, or `None` when it does not parse, or parses with
/// an `@` outside the user info.
#[cfg(feature = "_sql_server")]
fn redact_parsed(raw: &str) -> Option<String> {
    let mut url = url::Url::parse(raw).ok()?;
    let stray_at = [Some(url.path()), url.query(), url.fragment()]
        .into_iter()
        .flatten()
        .any(|part| part.contains('@') || part.to_ascii_lowercase().contains("%40"));
    if stray_at {
        return None;
    }
    if url.password().is_some_and(|p| !p.is_empty()) {
        url.set_password(Some("***")).ok()?;
    }
    Some(url.into())
}

/// Everything between `://` and the last `@` redacted, keeping a user name that stands
/// plainly before the first `:`.
#[cfg(feature = "_sql_server")]
fn redact_user_info(raw: &str) -> String {
    let Some((scheme, rest)) = raw.split_once("://") else {
        return raw.to_owned();
    };
    let Some((user_info, host)) = rest.rsplit_once('@') else {
        return raw.to_owned();
    };
    match user_info.split_once(':') {
        Some((user, _)) if !user.contains(['/', '?', '#', '@']) => {
            format!("{scheme}://{user}:***@{host}")
        }
        _ => format!("{scheme}://***@{host}"),
    }
}

/// Query parameter names that may hold a secret, as parts of the decoded, lowercased
/// name (`password`, `sslpassword`, `pass`, `pwd`, `secret`, `token`, `api_key`, ...).
#[cfg(feature = "_sql_server")]
const SECRET_PARAMS: [&str; 7] = [
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "auth",
    "credential",
];

/// The values of secret-bearing query parameters redacted. A value with an unencoded
/// `&` reads as more parameters; the pieces after it without a `=` are taken for the
/// rest of the value.
#[cfg(feature = "_sql_server")]
fn redact_query(url: &str) -> String {
    let Some((head, rest)) = url.split_once('?') else {
        return url.to_owned();
    };
    let (query, fragment) = match rest.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (rest, None),
    };
    let mut out = format!("{head}?");
    let mut in_secret = false;
    for (i, param) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match param.split_once('=') {
            Some((name, _)) => {
                let decoded = url::form_urlencoded::parse(name.as_bytes())
                    .next()
                    .map_or_else(|| name.to_owned(), |(n, _)| n.into_owned())
                    .to_ascii_lowercase();
                in_secret = SECRET_PARAMS.iter().any(|s| decoded.contains(s));
                out.push_str(name);
                out.push('=');
                if in_secret {
                    out.push_str("***");
                } else {
                    out.push_str(&param[name.len() + 1..]);
                }
            }
            None if in_secret => out.push_str("***"),
            None => out.push_str(param),
        }
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// A connection idle for longer than this is pinged before use: short enough that a
/// server restart is caught before a statement fails on a dead connection (restarts take
/// longer than this), long enough that a busy connection is never pinged.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// Pool options that ping a connection before use only when it sat idle past
/// [`IDLE_BEFORE_PING`]: sqlx's own test pings every connection it hands out, one extra
/// round trip per statement.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn pinged_when_idle<DB: sqlx::Database>(
    options: sqlx::pool::PoolOptions<DB>,
) -> sqlx::pool::PoolOptions<DB> {
    options
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > IDLE_BEFORE_PING {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "_sql_server")]
    #[test]
    fn tls_failures_say_what_to_change() {
        let unbuilt = std::io::Error::other(
            "TLS upgrade required by connect options but SQLx was built without TLS support \
             enabled",
        );
        let message = tls_failure(("sslmode", "sslrootcert"), &unbuilt);
        assert!(message.contains("enable its `tls-rustls`"), "{message}");
        let untrusted = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let message = tls_failure(("ssl-mode", "ssl-ca"), &untrusted);
        assert!(
            message.contains("UnknownIssuer") && message.contains("`ssl-ca=`"),
            "{message}"
        );
    }

    #[test]
    fn table_names() {
        assert!(TableName::parse("idem_operations", false).is_ok());
        assert!(TableName::parse("_x9", false).is_ok());
        assert!(TableName::parse(&"a".repeat(63), false).is_ok());
        for bad in [
            "",
            "9x",
            "a-b",
            "a b",
            "a\"b",
            "a;drop",
            &"a".repeat(64),
            "é",
        ] {
            assert!(TableName::parse(bad, true).is_err(), "{bad:?} accepted");
        }
        assert!(TableName::parse("s.t", false).is_err());
        let t = TableName::parse("s.t", true).unwrap();
        assert_eq!(t.qualified(), "\"s\".\"t\"");
        assert_eq!(t.bare(), "t");
        assert!(TableName::parse("s.t.u", true).is_err());
        assert!(TableName::parse(".t", true).is_err());
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn schema_qualified_ddl_is_renamed_with_its_indexes() {
        let t = TableName::parse("app.jobs", true).unwrap();
        assert_eq!(t.schema(), Some("app"));
        let sql = t.render_ddl(crate::schema::POSTGRES_SCHEMA_SQL);
        assert!(!sql.contains("idem_operations"), "{sql}");
        assert!(
            sql.contains("INDEX IF NOT EXISTS \"jobs_purge_idx\""),
            "{sql}"
        );
        assert!(sql.contains("ON \"app\".\"jobs\" (expires_at)"), "{sql}");
        assert!(
            sql.contains("CREATE TABLE IF NOT EXISTS \"app\".\"jobs_steps\""),
            "{sql}"
        );
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn long_table_names_keep_index_suffixes() {
        let long = TableName::parse(&"t".repeat(63), false).unwrap();
        let sql = long.render_ddl(crate::schema::SQLITE_SCHEMA_SQL);
        let purge = format!("\"{}_purge_idx\"", "t".repeat(53));
        assert!(sql.contains(&purge), "{sql}");
        let trigger = format!("\"{}_steps_del\"", "t".repeat(53));
        assert!(sql.contains(&trigger), "{sql}");
        assert!(!sql.contains("idem_operations"), "{sql}");
    }

    #[test]
    fn durations_are_clamped() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS);
        assert_eq!(duration_ms(-5), Duration::ZERO);
        assert_eq!(sql_epoch(u64::MAX), None);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn urls_are_redacted() {
        let cases = [
            (
                "postgres://u:secret@127.0.0.1:5432/db",
                "postgres://u:***@127.0.0.1:5432/db",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("sqlite::memory:", "sqlite::memory:"),
            ("postgres://u:p@ss@h/db?x=1", "postgres://u:***@h/db?x=1"),
            // Percent-encoded, and in the query under the names drivers read.
            (
                "postgres://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
                "postgres://u:***@127.0.0.1:1/db?password=***",
            ),
            (
                "mysql://u@h/db?ssl-mode=required&Pass%77ord=hunter2&pwd=x&token=y",
                "mysql://u@h/db?ssl-mode=required&Pass%77ord=***&pwd=***&token=***",
            ),
            // A value with an unencoded `&`: its tail is redacted with it.
            (
                "postgres://h/db?password=hun&ter2&sslmode=disable",
                "postgres://h/db?password=***&***&sslmode=disable",
            ),
            // Unencoded `/`, `?` and `#` in the password: the URL does not parse, or
            // parses with the password taken for a port and a path, query or fragment.
            (
                "postgres://u:s3cr/t@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            ("postgres://u:12/cd@h/db", "postgres://u:***@h/db"),
            ("postgres://u:pa?ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:12?ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:12#ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u/x:pw@h/db", "postgres://***@h/db"),
            (
                "postgres://u:pw@[::1]:5432/db",
                "postgres://u:***@[::1]:5432/db",
            ),
            ("postgres://:pw@h/db", "postgres://:***@h/db"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        for secret in [
            "hunter2", "s3cr", "12/cd", "12?ss", "pa?ss", "12#ss", "ter2", "x:pw",
        ] {
            for (url, _) in cases {
                if url.contains(secret) {
                    assert!(!redact_url(url).contains(secret), "{url}");
                }
            }
        }
    }

    fn row(mine: bool, state: i64, same: bool) -> ClaimRow {
        ClaimRow {
            mine,
            stale: false,
            state,
            epoch: 3,
            same_fingerprint: same,
            taken_over: false,
            resume: false,
            retry_after_ms: 250,
            outcome: (state == 1).then(|| b"1".to_vec()),
            outcome_is_err: false,
            outcome_version: 1,
        }
    }

    #[test]
    fn decision_table() {
        let claim = |r| match decide(r).unwrap() {
            Decision::Claim(c) => c,
            Decision::Reissue => panic!("reissue"),
        };
        assert_eq!(
            claim(row(true, 0, true)),
            Claim::Acquired {
                epoch: 3,
                takeover: false,
                resume: false
            }
        );
        let mut resumed = row(true, 0, true);
        resumed.resume = true;
        assert_eq!(
            claim(resumed),
            Claim::Acquired {
                epoch: 3,
                takeover: false,
                resume: true
            }
        );
        assert_eq!(
            claim(row(true, 2, true)),
            Claim::Unknown {
                epoch: 3,
                now: true
            }
        );
        assert_eq!(claim(row(false, 0, false)), Claim::Mismatch);
        assert_eq!(claim(row(false, 1, false)), Claim::Mismatch);
        assert_eq!(claim(row(false, 2, false)), Claim::Mismatch);
        assert_eq!(
            claim(row(false, 0, true)),
            Claim::InFlight {
                retry_after: Duration::from_millis(250)
            }
        );
        assert_eq!(
            claim(row(false, 2, true)),
            Claim::Unknown {
                epoch: 3,
                now: false
            }
        );
        assert!(
            matches!(claim(row(false, 1, true)), Claim::Completed(o) if o.body[..] == b"1"[..])
        );
        let mut stale = row(false, 1, false);
        stale.stale = true;
        assert_eq!(decide(stale).unwrap(), Decision::Reissue);
        assert!(decide(row(false, 7, true)).is_err());
        assert!(decide(row(true, 1, true)).is_err());
    }
}
