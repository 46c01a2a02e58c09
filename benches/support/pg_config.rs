//! The `pg` bench's configuration, and the tables of one run.

use sqlx::Executor;
use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::support::Res;
use crate::support::config::{Knobs, parsed, set};

pub struct Config {
    pub knobs: Knobs,
    pub pgbench_secs: u64,
    pub renew: bool,
    pub experiments: bool,
    pub prefix: String,
}

impl Config {
    pub fn from_env() -> Config {
        Config {
            knobs: Knobs::from_env(
                "IDEM_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            pgbench_secs: parsed("IDEM_BENCH_PGBENCH_SECS", 5),
            renew: !set("IDEM_BENCH_NO_RENEW"),
            experiments: set("IDEM_BENCH_EXPERIMENTS"),
            prefix: format!("idem_bench_{}", std::process::id()),
        }
    }

    /// The same pool for idem and for the baseline: sqlx's defaults, big enough.
    pub fn pool(&self) -> PgPoolOptions {
        self.knobs.pool()
    }
}

pub fn quoted(table: &str) -> String {
    format!("\"{table}\"")
}

/// The tables of one run, dropped at the end.
pub struct Tables {
    pub admin: PgPool,
    pub prefix: String,
    pub idem: Vec<String>,
    pub plain: Vec<String>,
}

impl Tables {
    /// A table name for idem to create (and migrate) itself.
    pub fn idem(&mut self, phase: &str) -> String {
        let table = format!("{}_{phase}", self.prefix);
        self.idem.push(table.clone());
        table
    }

    /// A new table from `ddl`, which names it `{table}` (quoted) or `{bare}`.
    pub async fn create(&mut self, ddl: &str, phase: &str) -> Res<String> {
        let table = format!("{}_{phase}", self.prefix);
        self.plain.push(table.clone());
        let ddl = ddl
            .replace("{table}", &quoted(&table))
            .replace("{bare}", &table);
        let sql = format!("DROP TABLE IF EXISTS {}; {ddl}", quoted(&table));
        sqlx::raw_sql(&sql).execute(&self.admin).await?;
        Ok(table)
    }

    /// A table shaped as idem's, from idem's shipped schema (its indexes renamed too).
    pub async fn idem_shaped(&mut self, phase: &str) -> Res<String> {
        let ddl = idem_runtime::schema::POSTGRES_SCHEMA_SQL.replace("idem_operations", "{bare}");
        self.create(&ddl, phase).await
    }

    pub async fn drop_all(&self) {
        for table in self.idem.iter().chain(&self.plain) {
            let drop = format!("DROP TABLE IF EXISTS {}", quoted(table));
            if let Err(e) = self.admin.execute(drop.as_str()).await {
                eprintln!("could not drop {table}: {e}");
            }
        }
        let bookkeeping: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('idem_schema_migrations')::text")
                .fetch_one(&self.admin)
                .await
                .unwrap_or(None);
        if bookkeeping.is_some() {
            let forgot =
                sqlx::query("DELETE FROM idem_schema_migrations WHERE table_name = ANY($1)")
                    .bind(&self.idem)
                    .execute(&self.admin)
                    .await;
            if let Err(e) = forgot {
                eprintln!("could not forget idem's bookkeeping: {e}");
            }
        }
    }
}

/// Settles freshly written tables (visibility map, statistics) before they are read.
pub async fn vacuum(admin: &PgPool, tables: &[&str]) -> Res<()> {
    let names: Vec<_> = tables.iter().map(|t| quoted(t)).collect();
    let sql = format!("VACUUM ANALYZE {}", names.join(", "));
    admin.execute(sql.as_str()).await?;
    Ok(())
}
