//! [`SqlHandle`]: the SQL store an [`Idem`](crate::Idem) was opened on, by database, so
//! transactional mode finds its statements for the caller's connection without the
//! `Store` trait in between.

use std::sync::Arc;

use super::engine::{Dialect, SqlStore};

/// An `Idem`'s SQL store, one variant a database.
#[derive(Clone)]
pub(crate) enum SqlHandle {
    #[cfg(feature = "sqlite")]
    Sqlite(Arc<SqlStore<super::sqlite::Sqlite>>),
    #[cfg(feature = "postgres")]
    Postgres(Arc<SqlStore<super::postgres::Pg>>),
    #[cfg(feature = "mysql")]
    MySql(Arc<SqlStore<super::mysql::MySql>>),
}

/// A dialect whose store an [`SqlHandle`] can hold. Public only to bound `SqlDb` in
/// the public `TxConnection` and `IntoStore`; nothing outside the crate can name it.
#[doc(hidden)]
#[allow(private_bounds, private_interfaces)]
pub trait Handled: Dialect {
    /// The handle on `store`.
    #[doc(hidden)]
    fn handle(store: Arc<SqlStore<Self>>) -> SqlHandle;

    /// The store `handle` holds, if it is of this dialect.
    #[doc(hidden)]
    fn store(handle: &SqlHandle) -> Option<&SqlStore<Self>>;
}

macro_rules! handled {
    ($($feature:literal, $dialect:ty, $variant:ident;)*) => {$(
        #[cfg(feature = $feature)]
        #[allow(private_interfaces)]
        impl Handled for $dialect {
            fn handle(store: Arc<SqlStore<Self>>) -> SqlHandle {
                SqlHandle::$variant(store)
            }

            #[allow(unreachable_patterns, reason = "one variant when one SQL feature is on")]
            fn store(handle: &SqlHandle) -> Option<&SqlStore<Self>> {
                match handle {
                    SqlHandle::$variant(store) => Some(store),
                    _ => None,
                }
            }
        }
    )*};
}

handled! {
    "sqlite", super::sqlite::Sqlite, Sqlite;
    "postgres", super::postgres::Pg, Postgres;
    "mysql", super::mysql::MySql, MySql;
}
