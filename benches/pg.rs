//! The PostgreSQL benchmark: idem against the same SQL issued directly through sqlx, and
//! against the pgbench floor (the fewest statements that give the same guarantee).
//!
//! ```text
//! cargo bench -p idem-tests --bench pg
//! ```
//!
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! `pgbench` on the `PATH` or under `/usr/lib/postgresql/*/bin`. Every table is new,
//! named after this process, and dropped at the end. Knobs, all optional:
//! `IDEM_BENCH_SECS` (one measurement, default 2), `IDEM_BENCH_ROUNDS` (A/B rounds, default
//! 3), `IDEM_BENCH_PGBENCH_SECS` (default 5), `IDEM_BENCH_NO_PING=1` (pools without sqlx's
//! ping on acquire), `IDEM_BENCH_NO_RENEW=1` (idem without its lease renewal task),
//! `IDEM_BENCH_EXPERIMENTS=1` (where the time goes: idem and the baseline on a pool
//! without the acquire ping, idem without lease renewal, the baseline on one held
//! connection per task, transactional mode's statements issued by sqlx, and pgbench
//! running idem's own SQL; about three minutes with `IDEM_BENCH_SECS=1.5`).
//!
//! The baseline's SQL is rendered by the store's own engine from `idem-runtime/sql/postgres/`,
//! so it is the store's SQL as built; the counted run checks on the wire that idem sends it.
//! Statements and round trips per operation are counted by a small TCP proxy that reads
//! the client's protocol messages (each `Query` or `Execute` is a statement; each `Sync`
//! or `Query` a round trip); `pg_stat_database.xact_commit` and `pg_stat_user_tables`
//! cross-check them on the server.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::Executor;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

mod support;
// The parts only this bench uses, beside the shared ones (see `support/mod.rs`).
#[path = "support/pg_config.rs"]
mod pg_config;
#[path = "support/pg_proxy.rs"]
mod pg_proxy;
#[path = "support/pg_report.rs"]
mod pg_report;
#[path = "support/pg_subject.rs"]
mod pg_subject;
#[path = "support/pgbench.rs"]
mod pgbench;

use pg_config::{Config, Tables, quoted, vacuum};
use pg_proxy::{COUNTED, Counter, Wire, spawn_proxy};
use pg_report::{
    FRESH, IDEM, IDEM_NO_RENEW, IDEM_OWN, IDEM_QUIET, Line, MIX, REPLAY, Report, SQLX, SQLX_HELD,
    SQLX_QUIET, SQLX_TX, SQLX_TX_NO_SAVEPOINT, TX,
};
use pg_subject::{Phase, Side, Subject, Templates};
use pgbench::{FRESH_SQL, Floor, REPLAY_SQL, TX_SQL, find_pgbench, idem_sql_script, idem_sql_vars};
use support::driver::{Contender, Stop, drive, rounds};
use support::{FINGERPRINT, NAME, Res};

/// Keys recorded before the replay phases (idem, sqlx and pgbench alike).
const REPLAY_KEYS: u64 = 5000;

/// The floor's table: idem's key and an outcome, nothing else.
const FLOOR_DDL: &str = "CREATE TABLE {table} (scope TEXT NOT NULL, name TEXT NOT NULL,
    key TEXT NOT NULL, outcome BYTEA, PRIMARY KEY (scope, name, key))";
const ORDERS_DDL: &str = "CREATE TABLE {table} (id TEXT PRIMARY KEY, qty BIGINT NOT NULL)";

fn main() -> Res<()> {
    support::block_on(async {
        let cfg = Config::from_env();
        let connect = PgConnectOptions::from_str(&cfg.knobs.url)?.application_name("idem-bench");
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(connect.clone())
            .await?;
        let mut tables = Tables {
            admin: admin.clone(),
            prefix: cfg.prefix.clone(),
            idem: Vec::new(),
            plain: Vec::new(),
        };
        let out = bench(&cfg, &connect, &mut tables).await;
        tables.drop_all().await;
        out
    })
}

async fn bench(cfg: &Config, connect: &PgConnectOptions, tables: &mut Tables) -> Res<()> {
    let admin = tables.admin.clone();
    let templates = Templates::load()?;
    let server: String = sqlx::query_scalar(
        "SELECT format('Server: PostgreSQL %s, synchronous_commit=%s, ssl=%s; %s cores here.',
            current_setting('server_version'), current_setting('synchronous_commit'),
            current_setting('ssl'), $1::text)",
    )
    .bind(
        std::thread::available_parallelism()
            .map_or(0, |n| n.get())
            .to_string(),
    )
    .fetch_one(&admin)
    .await?;
    println!("idem PostgreSQL benchmark: cargo bench -p idem-tests --bench pg");
    println!("binary: {}", std::env::args().collect::<Vec<_>>().join(" "));
    println!("{server}");
    let pgbench = find_pgbench();
    if pgbench.is_none() {
        println!("pgbench not found: the floor columns stay empty");
    }
    let orders_idem = tables.create(ORDERS_DDL, "orders").await?;
    let orders_base = tables.create(ORDERS_DDL, "b_orders").await?;
    let cnt_orders = tables.create(ORDERS_DDL, "cnt_orders").await?;
    let cnt_b_orders = tables.create(ORDERS_DDL, "cnt_b_orders").await?;

    // Counted first: short, and it checks the baseline's SQL before the long phases.
    println!("counting statements through the wire proxy...");
    let wire = Arc::new(Wire::default());
    let host = connect.get_host().to_owned();
    let proxy = spawn_proxy(host.clone(), connect.get_port(), wire.clone()).await?;
    let proxied = connect
        .clone()
        .host("127.0.0.1")
        .port(proxy)
        .ssl_mode(PgSslMode::Disable);
    let counter = Counter {
        admin: admin.clone(),
        pool: cfg.pool().connect_with(proxied).await?,
        wire,
    };
    let mut counts = Vec::new();
    let mut names = Vec::new();
    for c in [1, 16] {
        let it = tables.idem(&format!("cnt{c}"));
        let bt = tables.idem_shaped(&format!("b_cnt{c}")).await?;
        let i = Subject::idem(cfg, &counter.pool, it.clone(), &cnt_orders).await?;
        let b = Subject::sqlx(&templates, &counter.pool, bt.clone(), &cnt_b_orders, false);
        let fresh = (
            counter.count(&i, Phase::Fresh, c).await?,
            counter.count(&b, Phase::Fresh, c).await?,
        );
        let replay = Phase::Replay {
            from: 0,
            keys: 2 * COUNTED,
        };
        let replay = (
            counter.count(&i, replay, c).await?,
            counter.count(&b, replay, c).await?,
        );
        counts.push((fresh, replay));
        names.push([
            (it, "T"),
            (bt, "T"),
            (cnt_orders.clone(), "O"),
            (cnt_b_orders.clone(), "O"),
        ]);
    }
    let tx_count = {
        let it = tables.idem("cnttx");
        let bt = tables.idem_shaped("b_cnttx").await?;
        let i = Subject::idem(cfg, &counter.pool, it.clone(), &cnt_orders).await?;
        let b = Subject::sqlx(&templates, &counter.pool, bt.clone(), &cnt_b_orders, false);
        names.push([
            (it, "T"),
            (bt, "T"),
            (cnt_orders.clone(), "O"),
            (cnt_b_orders.clone(), "O"),
        ]);
        (
            counter.count(&i, Phase::Tx, 16).await?,
            counter.count(&b, Phase::Tx, 16).await?,
        )
    };
    counter.pool.close().await;
    let [(f1, r1), (f16, r16)]: [_; 2] = counts
        .try_into()
        .map_err(|_| "two concurrency levels were counted")?;
    // In the order of the lines: fresh and replay counts share their tables.
    let names = [0, 1, 1, 0, 1, 1, 2].map(|i| names[i].clone()).to_vec();

    let mut lines = vec![
        Line::new("fresh c=1", 1, FRESH),
        Line::new("fresh c=16", 16, FRESH),
        Line::new("fresh c=64", 64, FRESH),
        Line::new("replay c=1", 1, REPLAY),
        Line::new("replay c=16", 16, REPLAY),
        Line::new("50% dup c=16", 16, MIX),
        Line::new("tx fresh c=16", 16, TX),
    ];
    for (at, count) in [(0, f1), (1, f16), (3, r1), (4, r16), (6, tx_count)] {
        lines[at].count = Some(count);
    }

    // The floors, and pgbench through the proxy to count its statements.
    let floor_wire = Arc::new(Wire::default());
    let floor_port = spawn_proxy(host, connect.get_port(), floor_wire.clone()).await?;
    let mut floors = Vec::new();
    if let Some(bin) = pgbench.as_deref() {
        let fresh = tables.create(FLOOR_DDL, "pgb_fresh").await?;
        let replay = tables.create(FLOOR_DDL, "pgb_replay").await?;
        let tx = tables.create(FLOOR_DDL, "pgb_tx").await?;
        let orders = tables.create(ORDERS_DDL, "pgb_orders").await?;
        let populate = format!(
            "INSERT INTO {t} SELECT '', 'bench', g::text, '\\x31' \
             FROM generate_series(1, {REPLAY_KEYS}) g",
            t = quoted(&replay)
        );
        admin.execute(populate.as_str()).await?;
        vacuum(&admin, &[&replay]).await?;
        let fill = |script: &str, table: &str| {
            script
                .replace("{table}", &quoted(table))
                .replace("{orders}", &quoted(&orders))
                .replace("{rows}", &REPLAY_KEYS.to_string())
        };
        let floor = |name, script| Floor {
            bin,
            name,
            script,
            vars: Vec::new(),
        };
        floors = vec![
            floor("fresh", fill(FRESH_SQL, &fresh)),
            floor("replay", fill(REPLAY_SQL, &replay)),
            floor("tx", fill(TX_SQL, &tx)),
        ];
        if cfg.experiments {
            // idem's SQL on idem-shaped tables; replays of keys 1..=REPLAY_KEYS.
            let fresh = tables.idem_shaped("pgi_fresh").await?;
            let replay = tables.idem_shaped("pgi_replay").await?;
            let hex: String = FINGERPRINT.iter().map(|b| format!("{b:02x}")).collect();
            let populate = format!(
                "INSERT INTO {t} (scope, name, key, state, epoch, fingerprint, lease_until, \
                 created_at, claimed_at, expires_at, outcome, outcome_version) \
                 SELECT 'p', '{NAME}', g::text, 1, 1, '\\x{hex}', now(), now(), now(), \
                 now() + interval '1 day', '\\x31', 1 FROM generate_series(1, {REPLAY_KEYS}) g",
                t = quoted(&replay)
            );
            admin.execute(populate.as_str()).await?;
            vacuum(&admin, &[&replay]).await?;
            for (name, table, replay) in
                [("idem_fresh", fresh, false), ("idem_replay", replay, true)]
            {
                floors.push(Floor {
                    bin,
                    name,
                    script: idem_sql_script(&templates.render(&table), replay),
                    vars: idem_sql_vars(),
                });
            }
        }
    }
    let mut floor_counts = Vec::new();
    for floor in floors.iter().take(3) {
        floor_counts.push(floor.count(connect, floor_port, &floor_wire)?);
    }
    let run_floor = |line: &mut Line| -> Res<()> {
        let Some(floor) = floors.get(line.script).filter(|_| line.script <= TX) else {
            return Ok(());
        };
        line.floor = Some(floor.tps(&cfg.knobs.url, line.concurrency, cfg.pgbench_secs)?);
        line.floor_count = floor_counts.get(line.script).copied();
        // The experiments' scripts follow the floors', for the fresh and replay lines.
        if let Some(idem_sql) = floors.get(3 + line.script).filter(|_| line.script < TX) {
            line.floor_idem_sql =
                Some(idem_sql.tps(&cfg.knobs.url, line.concurrency, cfg.pgbench_secs)?);
        }
        Ok(())
    };

    let idem_pool = cfg.pool().connect_with(connect.clone()).await?;
    let base_pool = cfg.pool().connect_with(connect.clone()).await?;
    // Experiments: one pool without the ping on acquire, shared by idem and the baseline.
    let quiet_pool = if cfg.experiments {
        // Its idle connections close, so pgbench's 64 clients fit beside the other pools.
        let pool = cfg
            .pool()
            .test_before_acquire(false)
            .min_connections(0)
            .idle_timeout(Duration::from_secs(1));
        Some(pool.connect_with(connect.clone()).await?)
    } else {
        None
    };
    for line in &mut lines[..3] {
        println!("{}...", line.label);
        let c = line.concurrency;
        let fresh = Phase::Fresh;
        let it = tables.idem(&format!("fresh{c}"));
        let bt = tables.idem_shaped(&format!("b_fresh{c}")).await?;
        let mut subjects: Vec<Contender<Subject>> = vec![
            (
                IDEM,
                Subject::idem(cfg, &idem_pool, it, &orders_idem).await?,
                fresh,
            ),
            (
                SQLX,
                Subject::sqlx(&templates, &base_pool, bt, &orders_base, false),
                fresh,
            ),
            (
                IDEM_OWN,
                Subject::idem_own(
                    cfg,
                    &idem_pool,
                    tables.idem(&format!("o_fresh{c}")),
                    &orders_idem,
                )
                .await?,
                fresh,
            ),
        ];
        if let Some(quiet) = &quiet_pool {
            let t = tables.idem(&format!("q_fresh{c}"));
            let i = Subject::idem(cfg, quiet, t, &orders_idem).await?;
            subjects.push((IDEM_QUIET, i, fresh));
            let t = tables.idem(&format!("r_fresh{c}"));
            let i = Subject::idem_renewing(false, &idem_pool, t, &orders_idem).await?;
            subjects.push((IDEM_NO_RENEW, i, fresh));
            let t = tables.idem_shaped(&format!("qb_fresh{c}")).await?;
            let b = Subject::sqlx(&templates, quiet, t, &orders_base, false);
            subjects.push((SQLX_QUIET, b, fresh));
            let t = tables.idem_shaped(&format!("h_fresh{c}")).await?;
            let b = Subject::sqlx(&templates, &base_pool, t, &orders_base, true);
            subjects.push((SQLX_HELD, b, fresh));
        }
        line.rounds = rounds(&cfg.knobs, &subjects, c).await?;
        // Their connections closed, so pgbench's 64 clients fit under the server's limit.
        drop(subjects);
        run_floor(line)?;
    }

    println!("recording {REPLAY_KEYS} keys to replay...");
    let it = tables.idem("replay");
    let i = Subject::idem(cfg, &idem_pool, it.clone(), &orders_idem).await?;
    let bt = tables.idem_shaped("b_replay").await?;
    let b = Subject::sqlx(&templates, &base_pool, bt.clone(), &orders_base, false);
    drive(&i, Phase::Fresh, 16, Stop::Ops(REPLAY_KEYS)).await?;
    drive(&b, Phase::Fresh, 16, Stop::Ops(REPLAY_KEYS)).await?;
    vacuum(&admin, &[&it, &bt]).await?;
    let keys = Phase::Replay {
        from: 0,
        keys: REPLAY_KEYS,
    };
    // The experiments replay the same records: replays write nothing.
    let o = Subject::idem_own(cfg, &idem_pool, it.clone(), &orders_idem).await?;
    let mut subjects: Vec<Contender<Subject>> =
        vec![(IDEM, i, keys), (SQLX, b, keys), (IDEM_OWN, o, keys)];
    if let Some(quiet) = &quiet_pool {
        let i = Subject::idem(cfg, quiet, it.clone(), &orders_idem).await?;
        subjects.push((IDEM_QUIET, i, keys));
        let i = Subject::idem_renewing(false, &idem_pool, it.clone(), &orders_idem).await?;
        subjects.push((IDEM_NO_RENEW, i, keys));
        let b = Subject::sqlx(&templates, quiet, bt.clone(), &orders_base, false);
        subjects.push((SQLX_QUIET, b, keys));
        let b = Subject::sqlx(&templates, &base_pool, bt.clone(), &orders_base, true);
        subjects.push((SQLX_HELD, b, keys));
    }
    for line in &mut lines[3..5] {
        println!("{}...", line.label);
        let runs = || -> Vec<u64> {
            let runs = subjects.iter().map(|s| s.1.runs.load(Ordering::Relaxed));
            runs.collect()
        };
        let before = runs();
        line.rounds = rounds(&cfg.knobs, &subjects, line.concurrency).await?;
        if runs() != before {
            return Err("a replay ran the body".into());
        }
        run_floor(line)?;
    }

    let line = &mut lines[5];
    println!("{}...", line.label);
    let mix = Phase::Mix {
        from: 0,
        keys: REPLAY_KEYS,
    };
    let mixed: Vec<Contender<Subject>> = subjects
        .iter()
        .map(|(l, s, _)| (*l, s.clone(), mix))
        .collect();
    line.rounds = rounds(&cfg.knobs, &mixed, line.concurrency).await?;
    drop(mixed);

    let line = &mut lines[6];
    println!("{}...", line.label);
    let tx = Phase::Tx;
    let it = tables.idem("tx");
    let mut subjects: Vec<Contender<Subject>> = vec![
        (
            IDEM,
            Subject::idem(cfg, &idem_pool, it, &orders_idem).await?,
            tx,
        ),
        (
            SQLX,
            Subject::sqlx(&templates, &base_pool, bt, &orders_base, false),
            tx,
        ),
    ];
    if cfg.experiments {
        for (label, savepoint) in [(SQLX_TX, true), (SQLX_TX_NO_SAVEPOINT, false)] {
            let table = tables.idem_shaped(&format!("tx_{savepoint}")).await?;
            let orders = tables
                .create(ORDERS_DDL, &format!("tx_orders_{savepoint}"))
                .await?;
            let sql = templates.render(&table);
            let side = Side::SqlxTx { sql, savepoint };
            subjects.push((label, Subject::new(side, &base_pool, table, &orders), tx));
        }
    }
    line.rounds = rounds(&cfg.knobs, &subjects, 16).await?;
    run_floor(line)?;
    drop(subjects);
    idem_pool.close().await;
    base_pool.close().await;
    if let Some(quiet) = quiet_pool {
        quiet.close().await;
    }

    Report {
        cfg,
        server,
        lines,
        names,
        templates,
    }
    .print();
    Ok(())
}
