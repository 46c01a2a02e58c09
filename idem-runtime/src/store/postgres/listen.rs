//! Wake-ups from other processes: a task that `LISTEN`s on [`WAKE_CHANNEL`] on a
//! connection of its own and wakes this process's waiters, for as long as the store
//! lives.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};

use crate::store::{OperationId, WakeHub};

/// The channel on which record/release/mark_unknown/resolve announce that an operation
/// moved on, when someone waits on it. The payload is the JSON of its [`OperationId`].
const WAKE_CHANNEL: &str = "idem_wake";

/// The listening task, aborted when the store (its dialect) goes away.
#[derive(Debug)]
pub(super) struct Listener(tokio::task::JoinHandle<()>);

impl Listener {
    /// Starts listening on `runtime`, with a connection to the server of `options`.
    pub(super) fn spawn(
        runtime: &tokio::runtime::Handle,
        options: PgConnectOptions,
        hub: Arc<WakeHub>,
    ) -> Listener {
        Listener(runtime.spawn(listen(options, hub)))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The wake listener: one dedicated connection (its own pool of one, so it never takes a
/// connection from the store's pool) that `LISTEN`s on [`WAKE_CHANNEL`] and wakes this
/// process's waiters. `PgListener` reconnects and re-subscribes by itself; notifications
/// sent while it was down are lost, and those waiters fall back to polling the lease.
async fn listen(options: PgConnectOptions, hub: Arc<WakeHub>) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(100);
    const MAX_BACKOFF: Duration = Duration::from_secs(30);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(options);
    let mut backoff = FIRST_BACKOFF;
    let mut listener = loop {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(WAKE_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match connected.await {
            Ok(listener) => break listener,
            Err(e) => {
                tracing::warn!(error = %e, "idem: cannot LISTEN for wake-ups; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    };
    backoff = FIRST_BACKOFF;
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                backoff = FIRST_BACKOFF;
                match serde_json::from_str::<OperationId>(notification.payload()) {
                    Ok(id) => hub.wake(&id),
                    Err(e) => tracing::debug!(error = %e, "idem: ignoring a malformed wake-up"),
                }
            }
            Ok(None) => {
                tracing::debug!("idem: wake listener reconnected; wake-ups meanwhile were lost");
            }
            Err(e) => {
                tracing::warn!(error = %e, "idem: wake listener failed; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::engine::{Dialect, Sql, SqlOptions, Stmt, TableName};
    use crate::store::postgres::test_db::{TestDb, drop_table};
    use crate::store::postgres::{Pg, from_pool};
    use crate::store::test_support::*;
    use crate::store::{Claim, Fence, Store};
    use sqlx::Row as _;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn record_wakes_waiters_in_other_processes() {
        let Some(db) = TestDb::new("wake").await else {
            return;
        };
        let hub = Arc::new(WakeHub::default());
        db.store.attach_wakers(hub.clone());
        let wait = |id: &OperationId| hub.register(id, 10).expect("register waiter");

        // Until the listener is subscribed, NOTIFY by hand: this proves it is listening.
        let probe = op("probe");
        let waiter = wait(&probe);
        let payload = serde_json::to_string(&probe).unwrap();
        let listening = async {
            loop {
                let notified = waiter.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                sqlx::query("SELECT pg_notify('idem_wake', $1)")
                    .bind(&payload)
                    .execute(&db.admin)
                    .await
                    .unwrap();
                if tokio::time::timeout(Duration::from_millis(200), notified)
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(30), listening)
            .await
            .expect("the wake listener never subscribed");

        // Another process (the admin pool) records; the waiter announced itself first.
        let id = op("w-1");
        let Claim::Acquired { epoch, .. } = claim(&db.store, &id, FP, LEASE).await else {
            panic!("fresh claim expected");
        };
        let waiter = wait(&id);
        let notified = waiter.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        db.store.announce_wait(&id).await.unwrap();
        let other = from_pool(
            db.admin.clone(),
            &SqlOptions {
                table: db.table.clone(),
                migrate: false,
                ..SqlOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(
            other.record(&id, epoch, &outcome("1"), DAY).await.unwrap(),
            Fence::Held
        );
        tokio::time::timeout(Duration::from_secs(30), notified)
            .await
            .expect("record did not wake the waiter");

        // Without an announced waiter, nothing is sent.
        let quiet = op("w-2");
        let Claim::Acquired { epoch, .. } = claim(&db.store, &quiet, FP, LEASE).await else {
            panic!("fresh claim expected");
        };
        let table = TableName::parse(&db.table, true).unwrap();
        let release = Stmt::render::<Pg>(Pg::sql(Sql::Release), &table);
        let payload = serde_json::to_string(&quiet).unwrap();
        let row = sqlx::query(&release.sql)
            .bind(&quiet.scope)
            .bind(&quiet.name)
            .bind(&quiet.key)
            .bind(epoch as i64)
            .bind(&payload)
            .bind(DAY.as_millis() as i64)
            .fetch_one(&db.admin)
            .await
            .unwrap();
        assert_eq!(
            (row.get::<i64, _>("held"), row.get::<i64, _>("woke")),
            (1, 0)
        );
        db.cleanup().await;
    }

    #[tokio::test]
    async fn listener_stops_with_the_store() {
        let Some(db) = TestDb::new("listener").await else {
            return;
        };
        let hub = Arc::new(WakeHub::default());
        db.store.attach_wakers(hub.clone());
        // The task holds a clone of the hub; dropping the store aborts it and frees it.
        assert_eq!(Arc::strong_count(&hub), 2);
        let TestDb {
            store,
            admin,
            table,
        } = db;
        drop(store);
        tokio::time::timeout(Duration::from_secs(10), async {
            while Arc::strong_count(&hub) > 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("listener task still running after the store was dropped");
        drop_table(&admin, &table).await;
    }
}
