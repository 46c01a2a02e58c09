//! What the benches read of the stores: the statements as a store issues them, looked up
//! by their file's name. Not a stable API.

use super::engine::{Dialect, OptionalSql, Sql, Stmt, TableName};
use crate::IdemError;

/// The template of the statement whose file is `sql/<dialect>/<name>.sql`, as `D` has
/// it; a clear error for a name no statement has, or one `D` does not list.
fn template<D: Dialect>(db: &str, name: &str) -> Result<&'static str, IdemError> {
    let unknown = || IdemError::Config {
        message: format!("no statement `{name}` on {db}: no file `sql/{db}/{name}.sql` is one"),
    };
    if let Some(&sql) = Sql::ALL.iter().find(|s| s.file() == name) {
        return Ok(D::sql(sql));
    }
    let optional = OptionalSql::ALL.iter().find(|s| s.file() == name);
    optional
        .and_then(|&sql| D::optional_sql(sql))
        .ok_or_else(unknown)
}

/// The MySQL statement file `name` (`sql/mysql/<name>.sql`) rendered for `table`,
/// exactly as the store issues it: each statement with `?` placeholders, and the
/// names of the parameters those placeholders take, in order.
#[cfg(feature = "mysql")]
pub fn mysql_statements(name: &str, table: &str) -> Result<Vec<(String, Vec<String>)>, IdemError> {
    use super::mysql::{MySql, parts_with_params};
    let table = TableName::parse(table, false)?.backticked();
    let stmt = Stmt::render::<MySql>(template::<MySql>("mysql", name)?, &table);
    Ok(parts_with_params(&stmt))
}

/// The PostgreSQL statement `name` (`sql/postgres/<name>.sql`) rendered for `table`,
/// exactly as the store issues it.
#[cfg(feature = "postgres")]
pub fn postgres_statement(name: &str, table: &str) -> Result<String, IdemError> {
    use super::postgres::Pg;
    let table = TableName::parse(table, true)?;
    Ok(Stmt::render::<Pg>(template::<Pg>("postgres", name)?, &table).sql)
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;

    #[test]
    fn statements_are_found_by_their_file() {
        let purge = postgres_statement("purge_locked", "ops").unwrap();
        assert!(purge.contains("\"ops\""), "{purge}");
        assert!(postgres_statement("claim", "ops").is_ok());
        match postgres_statement("claim_frsh", "ops") {
            Err(IdemError::Config { message }) => {
                assert!(message.contains("`claim_frsh`"), "{message}")
            }
            other => panic!("a misspelt name is an error, got {other:?}"),
        }
    }
}
