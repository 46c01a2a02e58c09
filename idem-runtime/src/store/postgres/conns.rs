//! The connections idem holds for claims and records when it opened the database
//! itself, outside sqlx's pool, and the one call that runs a hot statement on them (or
//! on the pool, when there are none).

use std::sync::Mutex;

use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPool, PgRow};

use super::errors::READ_ONLY_TRANSACTION;
use crate::store::server::IDLE_BEFORE_PING;

/// A statement with its arguments bound.
pub(super) type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, PgArguments>;

/// Connections idem holds for its hot statements, outside sqlx's pool.
///
/// sqlx's pool pings every connection when it is returned (to catch one a cancelled
/// query left mid-protocol), one more round trip per statement than the statement
/// itself. Here a connection goes back only when its statement finished; one whose
/// statement was cancelled or failed on the wire is dropped (closed) instead, which
/// gives the same safety without the round trip.
#[derive(Debug)]
pub(super) struct Conns {
    options: PgConnectOptions,
    pub(super) permits: tokio::sync::Semaphore,
    idle: Mutex<Vec<(PgConnection, std::time::Instant)>>,
}

impl Conns {
    pub(super) fn new(options: PgConnectOptions, max: u32) -> Conns {
        Conns {
            options,
            permits: tokio::sync::Semaphore::new(max.max(1) as usize),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `query` on an idle connection (or a new one) and returns the connection
    /// only if the statement completed.
    pub(super) async fn fetch_all(&self, query: Query<'_>) -> Result<Vec<PgRow>, sqlx::Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let mut conn = self.take().await?;
        let out = query.fetch_all(&mut conn).await;
        // A statement error leaves the connection ready for the next statement; an I/O
        // or protocol error, or the server ending the session (SQLSTATE classes 08 and
        // 57, as in a shutdown or `pg_terminate_backend`), does not. Nor does a
        // read-only refusal (25006): the server is a standby or was demoted, and a new
        // connection may reach the primary that replaced it.
        let reusable = match &out {
            Ok(_) => true,
            Err(sqlx::Error::Database(e)) => !e.code().is_some_and(|c| {
                c.starts_with("08") || c.starts_with("57") || c == READ_ONLY_TRANSACTION
            }),
            Err(_) => false,
        };
        if reusable {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.push((conn, std::time::Instant::now()));
        }
        out
    }

    async fn take(&self) -> Result<PgConnection, sqlx::Error> {
        loop {
            let next = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let Some((mut conn, since)) = next else {
                return sqlx::Connection::connect_with(&self.options).await;
            };
            if since.elapsed() <= IDLE_BEFORE_PING
                || sqlx::Connection::ping(&mut conn).await.is_ok()
            {
                return Ok(conn);
            }
        }
    }
}

/// Runs a claim's or a record's statement on idem's own connections, or on the pool
/// when it has none.
pub(super) async fn hot(
    pool: &PgPool,
    owned: Option<&Conns>,
    query: Query<'_>,
) -> Result<Vec<PgRow>, sqlx::Error> {
    match owned {
        Some(conns) => conns.fetch_all(query).await,
        None => query.fetch_all(pool).await,
    }
}
