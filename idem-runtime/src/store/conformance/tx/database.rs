//! The databases transactional mode's checks run on: [`TxDatabase`] and its impl for
//! each of SQLite, PostgreSQL and MySQL/MariaDB.

use sqlx::{Pool, Transaction};

use super::BoxFuture;
use crate::TxConnection;

mod sealed {
    pub trait Sealed {}
}

/// A database transactional mode runs on: `sqlx::Sqlite`, `sqlx::Postgres` or
/// `sqlx::MySql`, each under its feature. Sealed: the checks' own statements are
/// written for these.
pub trait TxDatabase: sqlx::Database + sealed::Sealed {
    /// `Transaction<'static, Self>`, named through the trait so that generic code
    /// needs no `Transaction<'static, DB>: TxConnection` bound, which would hide
    /// that a transaction of any lifetime is `Send` and keep the checks' futures
    /// from being spawned.
    #[doc(hidden)]
    type Tx: TxConnection;
    /// `tx` as [`Tx`](Self::Tx).
    #[doc(hidden)]
    fn tx<'a>(tx: &'a mut Transaction<'static, Self>) -> &'a mut Self::Tx;
    /// Runs `sql`, which binds nothing, on `conn`, over the text protocol (MySQL does
    /// not prepare savepoint statements).
    #[doc(hidden)]
    fn execute(conn: &mut Self::Connection, sql: String) -> BoxFuture<'_, Result<(), sqlx::Error>>;
    /// The `(id, qty)` rows that `sql` selects through `pool`.
    #[doc(hidden)]
    fn rows(
        pool: &Pool<Self>,
        sql: String,
    ) -> BoxFuture<'static, Result<Vec<(String, i64)>, sqlx::Error>>;
}

// Concrete per database, so the checks need no sqlx bounds of their own; boxed, so
// their futures stay `Send` whatever the connection's lifetime.
macro_rules! tx_database {
    ($feature:literal, $db:ty) => {
        #[cfg(feature = $feature)]
        impl sealed::Sealed for $db {}
        #[cfg(feature = $feature)]
        impl TxDatabase for $db {
            type Tx = Transaction<'static, $db>;
            fn tx<'a>(tx: &'a mut Transaction<'static, Self>) -> &'a mut Self::Tx {
                tx
            }
            fn execute(
                conn: &mut Self::Connection,
                sql: String,
            ) -> BoxFuture<'_, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    use sqlx::Executor as _;
                    conn.execute(sqlx::raw_sql(&sql)).await.map(drop)
                })
            }
            fn rows(
                pool: &Pool<Self>,
                sql: String,
            ) -> BoxFuture<'static, Result<Vec<(String, i64)>, sqlx::Error>> {
                let pool = pool.clone();
                Box::pin(async move { sqlx::query_as(&sql).fetch_all(&pool).await })
            }
        }
    };
}
tx_database!("sqlite", sqlx::Sqlite);
tx_database!("postgres", sqlx::Postgres);
tx_database!("mysql", sqlx::MySql);
