//! The operations table as the SQL stores name it and set it up: [`SqlOptions`] (which
//! table, whether idem creates it, the key mode), [`TableName`] (a validated name, how
//! it and its companions are written into statements and the shipped DDL), and the
//! check of the key mode the table recorded.

use crate::error::IdemError;
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
    /// steps table), `{claim_limits}` (the shared claim counts) and `{now}` filled in.
    pub(crate) fn render(&self, template: &str, now: &str) -> String {
        template
            .replace("{table}", &self.qualified())
            .replace("{meta}", &self.companion("_meta"))
            .replace("{epoch_seq}", &self.companion("_epoch_seq"))
            .replace("{steps}", &self.companion("_steps"))
            .replace("{claim_limits}", &self.companion("_claim_limits"))
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
