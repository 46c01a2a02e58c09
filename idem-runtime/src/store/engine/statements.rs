//! The statements: their names, checked when the crate compiles, and their rendering.
//!
//! One table ([`statement_table!`]) names every statement the engine and the dialects
//! issue, each a variant with its file, `sql/<dialect>/<file>.sql`. [`Sql`] are the
//! statements every dialect has; [`OptionalSql`], those a dialect has only where it
//! lists them. A dialect's [`dialect_sql!`] call makes its `Dialect::sql` and
//! `Dialect::optional_sql` from that table: a misspelt name does not compile, nor does
//! a dialect missing a required statement's file (each is an `include_str!`). A
//! [`Stmt`] is a statement rendered for a table, with the dialect's placeholders;
//! [`Statements`] are all of them, rendered once per store. The claim statement's row,
//! and what it decides ([`decide`]), are here too: what each column of that row means is
//! the statement's contract.

use super::values::{Arg, Row, corrupt, duration_ms, epoch_from_sql, outcome_from_sql};
use super::{Dialect, TableName};
use crate::error::StoreError;
use crate::store::Claim;

/// The statement table: every statement's variant and the name of its file in
/// `sql/<dialect>/`, first those every dialect has ([`Sql`]), then the optional ones
/// ([`OptionalSql`]). It hands the table to the macro `$then` (in this module), with
/// `$args` before it: [`define_names!`] makes the enums, [`dialect_sql!`] a dialect's
/// texts.
macro_rules! statement_table {
    ($then:ident!($($args:tt)*)) => {
        $crate::store::engine::$then! {
            ($($args)*)
            required {
                /// The claim: one atomic step that inserts, takes over, or reads the
                /// record, and answers with the row [`decide`] reads.
                Claim = "claim",
                /// The outcome of a claim held at `:epoch` (fenced).
                Record = "record",
                /// A claim given up: the record goes, or waits with its steps.
                Release = "release",
                /// A claim whose effect is unknown moves to UNKNOWN.
                MarkUnknown = "mark_unknown",
                /// A lease extended.
                Renew = "renew",
                /// An operator's resolution that records an outcome.
                ResolveRecord = "resolve_record",
                /// An operator's resolution that removes (or releases) the record.
                ResolveDelete = "resolve_delete",
                /// An operator's deletion of a settled or lapsed record.
                Forget = "forget",
                /// A batch of expired records deleted.
                Purge = "purge",
                /// Counts by state.
                Stats = "stats",
                /// Records matching a filter.
                List = "list",
                /// One record in full.
                Get = "get",
                /// Reads every column idem reads, so a missing one fails the open.
                Probe = "probe",
                /// Records the key mode, unless one is recorded.
                SetKeyMode = "set_key_mode",
                /// Reads the recorded key mode.
                GetKeyMode = "get_key_mode",
                /// Transactional mode: the insert of a fresh claim.
                TxClaim = "tx_claim",
                /// Transactional mode: the row the insert conflicted with.
                TxRead = "tx_read",
                /// Transactional mode: a fresh claim over an expired record.
                TxReclaim = "tx_reclaim",
                /// Transactional mode: the takeover of a lapsed claim.
                TxTakeover = "tx_takeover",
                /// Transactional mode: the outcome, fenced on the epoch.
                TxRecord = "tx_record",
                /// The outcome of one step, under the claim.
                RecordStep = "record_step",
                /// The steps of the operation's current life.
                Steps = "steps",
                /// Fragment `{expired}`: a completed record past its retention.
                Expired = "expired",
                /// Fragment `{lapsed}`: a claim whose lease has run out.
                Lapsed = "lapsed",
                /// Fragment `{released}`: a record released with its steps kept.
                Released = "released",
                /// Creates idem's bookkeeping of applied migrations.
                MigrationsBookkeeping = "migrations_bookkeeping",
                /// Whether the table exists.
                TableExists = "table_exists",
                /// Forgets the migrations of a table that was dropped.
                ForgetMigrations = "forget_migrations",
                /// The migrations applied to the table.
                AppliedMigrations = "applied_migrations",
                /// Records one migration applied.
                RecordMigration = "record_migration",
            }
            optional {
                /// The replay read: a completed outcome, without writing.
                Peek = "peek",
                /// A plain insert for a key with no record, tried before the claim.
                ClaimFresh = "claim_fresh",
                /// Marks an operation as waited on, so its end wakes other processes.
                AnnounceWait = "announce_wait",
                /// Wakes other processes' waiters after a write that did not.
                Wake = "wake",
                /// The purge that skips rows another transaction holds.
                PurgeLocked = "purge_locked",
                /// Fragment `{claim_conflict}`: the claim's conflict clause.
                ClaimConflict = "claim_conflict",
                /// Group commit: many callers' claims in one statement.
                ClaimBatch = "claim_batch",
                /// Group commit: many callers' fresh inserts in one statement.
                ClaimFreshBatch = "claim_fresh_batch",
                /// Group commit: many callers' records in one statement.
                RecordBatch = "record_batch",
                /// A shared claim limit: one claim from a key's allowance (GCRA).
                TakeClaimToken = "take_claim_token",
                /// A shared claim limit: the counts whose allowance is whole again.
                PurgeClaimTokens = "purge_claim_tokens",
            }
        }
    };
}
pub(crate) use statement_table;

/// Makes [`Sql`] and [`OptionalSql`] from the [`statement_table!`].
macro_rules! define_names {
    (
        ()
        required { $($(#[$rdoc:meta])* $req:ident = $req_file:literal,)* }
        optional { $($(#[$odoc:meta])* $opt:ident = $opt_file:literal,)* }
    ) => {
        /// A statement every dialect has, named by its file in `sql/<dialect>/`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum Sql {
            $($(#[$rdoc])* $req,)*
        }

        /// A statement a dialect has only where its [`dialect_sql!`] call lists it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[allow(dead_code, reason = "only the dialects that list a statement name it")]
        pub(crate) enum OptionalSql {
            $($(#[$odoc])* $opt,)*
        }

        #[allow(dead_code, reason = "for the bench hook and the tests")]
        impl Sql {
            /// Every one, in the table's order.
            pub(crate) const ALL: &[Sql] = &[$(Sql::$req,)*];

            /// The name of its file, `sql/<dialect>/<name>.sql`.
            pub(crate) const fn file(self) -> &'static str {
                match self {
                    $(Sql::$req => $req_file,)*
                }
            }
        }

        #[allow(dead_code, reason = "for the bench hook and the tests")]
        impl OptionalSql {
            /// Every one, in the table's order.
            pub(crate) const ALL: &[OptionalSql] = &[$(OptionalSql::$opt,)*];

            /// The name of its file, `sql/<dialect>/<name>.sql`.
            pub(crate) const fn file(self) -> &'static str {
                match self {
                    $(OptionalSql::$opt => $opt_file,)*
                }
            }
        }
    };
}
pub(crate) use define_names;

statement_table!(define_names!());

/// A dialect's `Dialect::sql` and `Dialect::optional_sql`, in its `impl Dialect`: the
/// statements of `sql/<dir>/`, every [`Sql`] and the [`OptionalSql`]s listed after
/// `dir`, included when the crate compiles.
///
/// ```text
/// dialect_sql!("sqlite", Peek, ClaimBatch, RecordBatch);
/// ```
macro_rules! dialect_sql {
    ($dir:literal $(, $listed:ident)* $(,)?) => {
        $crate::store::engine::statement_table!(
            dialect_sql_from_table!($dir, [$($listed),*])
        );
    };
}
pub(crate) use dialect_sql;

/// [`dialect_sql!`]'s work, given the [`statement_table!`].
macro_rules! dialect_sql_from_table {
    (
        ($dir:literal, [$($listed:ident),*])
        required { $($(#[$rdoc:meta])* $req:ident = $req_file:literal,)* }
        optional { $($(#[$odoc:meta])* $opt:ident = $opt_file:literal,)* }
    ) => {
        fn sql(name: $crate::store::engine::Sql) -> &'static str {
            use $crate::store::engine::Sql;
            match name {
                $(Sql::$req => include_str!(concat!(
                    env!("CARGO_MANIFEST_DIR"), "/sql/", $dir, "/", $req_file, ".sql"
                )),)*
            }
        }

        fn optional_sql(name: $crate::store::engine::OptionalSql) -> Option<&'static str> {
            use $crate::store::engine::OptionalSql;
            // Each optional statement's file, by its variant.
            macro_rules! file_of {
                $(($opt) => { $opt_file };)*
            }
            #[allow(unreachable_patterns, reason = "a dialect may list every optional statement")]
            match name {
                $(OptionalSql::$listed => Some(include_str!(concat!(
                    env!("CARGO_MANIFEST_DIR"), "/sql/", $dir, "/", file_of!($listed), ".sql"
                ))),)*
                _ => None,
            }
        }
    };
}
pub(crate) use dialect_sql_from_table;

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
    /// The parameters' names in positional order (per placeholder where the dialect's
    /// placeholders are not numbered).
    pub(crate) params: Vec<String>,
}

impl Stmt {
    /// Renders `template`: fragments and names (`{table}`, `{now}`, ...) filled in, each
    /// `:name` parameter replaced by the dialect's placeholder for its position.
    pub(crate) fn render<D: Dialect>(template: &str, table: &TableName) -> Stmt {
        let expanded = template
            // A shared fragment first: it holds the names below.
            .replace(
                "{claim_conflict}",
                D::optional_sql(OptionalSql::ClaimConflict).map_or("", str::trim),
            )
            // A released record resumes whatever `on_takeover` says: its last attempt
            // ended knowing what it had done.
            .replace("{rerun}", "(({lapsed} AND NOT :to_unknown) OR {released})")
            .replace(
                "{to_unknown}",
                "({lapsed} AND :to_unknown AND NOT {released})",
            )
            .replace("{lapsed}", D::sql(Sql::Lapsed).trim())
            .replace("{released}", D::sql(Sql::Released).trim())
            .replace("{expired}", D::sql(Sql::Expired).trim())
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

/// Every statement, rendered once for the store's table.
#[derive(Debug)]
pub(super) struct Statements {
    pub(super) claim: Stmt,
    pub(super) claim_fresh: Option<Stmt>,
    pub(super) peek: Option<Stmt>,
    pub(super) record: Stmt,
    pub(super) release: Stmt,
    pub(super) mark_unknown: Stmt,
    pub(super) renew: Stmt,
    pub(super) resolve_record: Stmt,
    pub(super) resolve_delete: Stmt,
    pub(super) forget: Stmt,
    pub(super) record_step: Stmt,
    pub(super) steps: Stmt,
    pub(super) announce_wait: Option<Stmt>,
    /// Sent after a fenced write whose row says a caller waits, where the write does
    /// not wake them itself.
    pub(super) wake: Option<Stmt>,
    pub(super) purge: Stmt,
    pub(super) purge_locked: Option<Stmt>,
    pub(super) stats: Stmt,
    pub(super) list: Stmt,
    pub(super) get: Stmt,
    pub(super) tx_claim: Stmt,
    pub(super) tx_read: Stmt,
    pub(super) tx_reclaim: Stmt,
    pub(super) tx_takeover: Stmt,
    pub(super) tx_record: Stmt,
    pub(super) take_claim_token: Option<Stmt>,
    pub(super) purge_claim_tokens: Option<Stmt>,
}

impl Statements {
    pub(super) fn new<D: Dialect>(table: &TableName) -> Statements {
        let r = |name: Sql| Stmt::render::<D>(D::sql(name), table);
        let optional =
            |name: OptionalSql| D::optional_sql(name).map(|sql| Stmt::render::<D>(sql, table));
        Statements {
            claim: r(Sql::Claim),
            claim_fresh: optional(OptionalSql::ClaimFresh),
            peek: optional(OptionalSql::Peek),
            record: r(Sql::Record),
            release: r(Sql::Release),
            mark_unknown: r(Sql::MarkUnknown),
            renew: r(Sql::Renew),
            resolve_record: r(Sql::ResolveRecord),
            resolve_delete: r(Sql::ResolveDelete),
            forget: r(Sql::Forget),
            record_step: r(Sql::RecordStep),
            steps: r(Sql::Steps),
            announce_wait: optional(OptionalSql::AnnounceWait),
            wake: optional(OptionalSql::Wake),
            purge: r(Sql::Purge),
            purge_locked: optional(OptionalSql::PurgeLocked),
            stats: r(Sql::Stats),
            list: r(Sql::List),
            get: r(Sql::Get),
            tx_claim: r(Sql::TxClaim),
            tx_read: r(Sql::TxRead),
            tx_reclaim: r(Sql::TxReclaim),
            tx_takeover: r(Sql::TxTakeover),
            tx_record: r(Sql::TxRecord),
            take_claim_token: optional(OptionalSql::TakeClaimToken),
            purge_claim_tokens: optional(OptionalSql::PurgeClaimTokens),
        }
    }
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

pub(super) fn claim_row(row: &Row) -> Result<ClaimRow, StoreError> {
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

/// Renders every statement `D` has, as a store on `table` would: a test of each
/// dialect's calls this, so that every file its [`dialect_sql!`] call claims is read and
/// filled in (that each exists is checked when the crate compiles).
#[cfg(test)]
pub(crate) fn render_all<D: Dialect>(table: &TableName) -> Vec<(&'static str, Stmt)> {
    let required = Sql::ALL.iter().map(|&s| (s.file(), D::sql(s)));
    let optional = (OptionalSql::ALL.iter()).filter_map(|&s| Some((s.file(), D::optional_sql(s)?)));
    let mut rendered = Vec::new();
    for (file, template) in required.chain(optional) {
        let stmt = Stmt::render::<D>(template, table);
        assert!(!stmt.sql.trim().is_empty(), "{file}.sql is empty");
        for name in [
            "{table}",
            "{meta}",
            "{steps}",
            "{claim_limits}",
            "{now}",
            "{lapsed}",
            "{expired}",
            "{released}",
            "{next_epoch}",
            "{rerun}",
            "{to_unknown}",
            "{claim_conflict}",
        ] {
            assert!(
                !stmt.sql.contains(name),
                "{file}.sql keeps {name}: {}",
                stmt.sql
            );
        }
        rendered.push((file, stmt));
    }
    rendered
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
