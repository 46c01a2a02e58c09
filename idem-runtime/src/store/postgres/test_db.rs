//! The PostgreSQL the dialect's tests run against: a store on a table of its own,
//! dropped with its bookkeeping afterwards; skipped where no server answers.

use std::str::FromStr;
use std::time::Duration;

use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::{PgStore, open};
use crate::store::engine::{SqlOptions, TableName};
use crate::store::server::redact_url;

pub(super) fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A store on its own table, dropped (with its bookkeeping) by [`TestDb::cleanup`].
pub(super) struct TestDb {
    pub(super) store: PgStore,
    pub(super) admin: PgPool,
    pub(super) table: String,
}

/// Whether anything listens at the URL's host and port, asked once with a short
/// timeout, so a machine without PostgreSQL skips at once rather than waiting out a
/// pool's connect timeout in every test.
fn reachable(url: &str) -> bool {
    static UP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UP.get_or_init(|| {
        use std::net::ToSocketAddrs;
        let Ok(opts) = PgConnectOptions::from_str(url) else {
            return false;
        };
        (opts.get_host(), opts.get_port())
            .to_socket_addrs()
            .is_ok_and(|mut addrs| {
                addrs.any(|a| {
                    std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok()
                })
            })
    })
}

impl TestDb {
    /// `None` (after one line on stdout) when PostgreSQL is not reachable, unless
    /// `IDEM_REQUIRE_DB=1`.
    pub(super) async fn new(test: &str) -> Option<TestDb> {
        Self::with_table(&format!("idem_t_{test}_{}", std::process::id())).await
    }

    pub(super) async fn with_table(table: &str) -> Option<TestDb> {
        let url = url();
        let required = std::env::var("IDEM_REQUIRE_DB").as_deref() == Ok("1");
        let skip = || {
            use std::io::Write;
            // Straight to stderr: the harness captures `println!` of passing tests.
            let _ = writeln!(
                std::io::stderr(),
                "skipping: PostgreSQL not reachable at {} (set IDEM_POSTGRES_URL)",
                redact_url(&url)
            );
        };
        if !required && !reachable(&url) {
            skip();
            return None;
        }
        let admin = match PgPoolOptions::new().max_connections(2).connect(&url).await {
            Ok(pool) => pool,
            Err(_) if !required => {
                skip();
                return None;
            }
            Err(e) => panic!("PostgreSQL not reachable at {url} and IDEM_REQUIRE_DB=1: {e}"),
        };
        drop_table(&admin, table).await;
        let opts = SqlOptions {
            table: table.to_owned(),
            migrate: true,
            ..SqlOptions::default()
        };
        let store = open(&url, &opts).await.expect("open PostgreSQL store");
        Some(TestDb {
            store,
            admin,
            table: table.to_owned(),
        })
    }

    pub(super) async fn cleanup(self) {
        let TestDb {
            store,
            admin,
            table,
        } = self;
        store.dialect.pool.close().await;
        drop_table(&admin, &table).await;
    }
}

pub(super) async fn drop_table(admin: &PgPool, table: &str) {
    let name = TableName::parse(table, true).unwrap();
    let drop = format!(
        "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP SEQUENCE IF EXISTS {}; \
         DROP TABLE IF EXISTS {}",
        name.qualified(),
        name.companion("_meta"),
        name.companion("_epoch_seq"),
        name.companion("_steps")
    );
    admin.execute(drop.as_str()).await.expect("drop test table");
    let forget = format!(
        "DO $$ BEGIN IF to_regclass('{bk}') IS NOT NULL THEN \
         DELETE FROM {bk} WHERE table_name = '{bare}'; END IF; END $$",
        bk = name.sibling("idem_schema_migrations"),
        bare = name.bare(),
    );
    admin
        .execute(forget.as_str())
        .await
        .expect("forget test bookkeeping");
}
