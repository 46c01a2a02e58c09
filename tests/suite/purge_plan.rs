//! The plan PostgreSQL picks for a purge batch: each kind of expired record read
//! through its partial index on `expires_at`, never a scan of the whole operations
//! table, whether the table is small, large, or mostly a backlog of expired records.
#![cfg(feature = "postgres")]
use crate::common;
use idem_runtime::Idem;
use sqlx::Row;

const PURGE: &str = include_str!("../../idem-runtime/sql/postgres/purge.sql");
const PURGE_LOCKED: &str = include_str!("../../idem-runtime/sql/postgres/purge_locked.sql");

/// A purge statement for `table`, its names filled in as the store fills them (the
/// test's table name needs no quoting) and its batch size a literal: a bound parameter
/// would leave EXPLAIN a generic plan to guess at.
fn render(template: &str, table: &str) -> String {
    template
        .replace("{table}", table)
        .replace("{steps}", &format!("{table}_steps"))
        .replace(":limit", "1000")
}

/// Adds `n` rows under keys `{tag}-{i}`: `state`, `steps` and `expires_at` as given,
/// the other columns what a claim would write.
async fn insert(
    pool: &sqlx::PgPool,
    table: &str,
    tag: &str,
    n: u32,
    (state, steps): (i16, i16),
    expires_at: &str,
) {
    sqlx::query(&format!(
        "INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, lease_until, \
         created_at, claimed_at, expires_at, steps) \
         SELECT '', 'charge', '{tag}-' || i, {state}, i, '\\x00'::bytea, now(), now(), now(), \
         {expires_at}, {steps} FROM generate_series(1, {n}) AS i"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// What the plan of `sql` does wrong on `table`, if anything: every Seq Scan of the
/// table, and each partial index it does not read.
async fn plan_faults(pool: &sqlx::PgPool, table: &str, what: &str, sql: &str) -> Vec<String> {
    let row = sqlx::query(&format!("EXPLAIN (FORMAT JSON) {sql}"))
        .fetch_one(pool)
        .await
        .unwrap();
    // The json type's binary form is its text; the suite's sqlx has no json feature.
    let text: String = row.try_get_unchecked(0).unwrap();
    let plan: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut nodes = Vec::new();
    collect(&plan[0]["Plan"], &mut nodes);
    let field = |node: &serde_json::Value, key: &str| node[key].as_str().unwrap_or("").to_owned();
    let mut faults: Vec<String> = nodes
        .iter()
        .filter(|n| field(n, "Node Type") == "Seq Scan" && field(n, "Relation Name") == table)
        .map(|_| format!("{what}: a Seq Scan on {table}"))
        .collect();
    for index in ["purge_idx", "released_idx"].map(|s| format!("{table}_{s}")) {
        let read = nodes.iter().any(|n| {
            field(n, "Index Name") == index
                && ["Index Scan", "Index Only Scan", "Bitmap Index Scan"]
                    .contains(&field(n, "Node Type").as_str())
        });
        if !read {
            faults.push(format!("{what}: {index} not read"));
        }
    }
    if !faults.is_empty() {
        faults.push(format!("{what}'s plan: {plan:#}"));
    }
    faults
}

/// `node` and every node under it.
fn collect<'a>(node: &'a serde_json::Value, into: &mut Vec<&'a serde_json::Value>) {
    into.push(node);
    for child in node["Plans"].as_array().into_iter().flatten() {
        collect(child, into);
    }
}

#[tokio::test]
async fn purge_reads_partial_indexes() {
    let test = "purge_reads_partial_indexes";
    if common::postgres_skip(test).is_some() {
        return;
    }
    let url = common::postgres_url();
    let table = common::unique_table("purge_plan");
    // The open creates the table and its indexes, named after it.
    drop(Idem::builder().table(&table).postgres(&url).await.unwrap());
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (live, past) = ("now() + interval '1 day'", "now() - interval '1 hour'");
    let (in_progress, completed, unknown, released) = ((0, 0), (1, 0), (2, 0), (0, 2));
    let mut faults = Vec::new();
    // Grown in stages, planned after each: the cheapest plan changes with the table's
    // size and with the share of it that is due.
    for stage in ["small", "large", "backlog"] {
        match stage {
            "small" => {
                insert(&pool, &table, "s-done", 1_500, completed, live).await;
                insert(&pool, &table, "s-run", 300, in_progress, "NULL").await;
                insert(&pool, &table, "s-exp", 150, completed, past).await;
                insert(&pool, &table, "s-rel", 50, released, past).await;
            }
            "large" => {
                insert(&pool, &table, "l-done", 120_000, completed, live).await;
                insert(&pool, &table, "l-run", 20_000, in_progress, "NULL").await;
                insert(&pool, &table, "l-unk", 2_000, unknown, "NULL").await;
                insert(&pool, &table, "l-keep", 2_000, released, live).await;
                insert(&pool, &table, "l-exp", 2_000, completed, past).await;
                insert(&pool, &table, "l-rel", 500, released, past).await;
            }
            _ => {
                insert(&pool, &table, "b-exp", 45_000, completed, past).await;
                insert(&pool, &table, "b-rel", 5_000, released, past).await;
            }
        }
        sqlx::query(&format!("ANALYZE {table}"))
            .execute(&pool)
            .await
            .unwrap();
        for (name, template) in [("purge.sql", PURGE), ("purge_locked.sql", PURGE_LOCKED)] {
            let what = format!("{name} ({stage} table)");
            faults.extend(plan_faults(&pool, &table, &what, &render(template, &table)).await);
        }
    }
    // One statement each: Cleanup sends its drops as one multi-statement query, which
    // PostgreSQL refuses as a prepared statement, and this table is a large one to leave.
    for drop in [
        format!("DROP TABLE IF EXISTS {table}, {table}_steps, {table}_claim_limits, {table}_meta"),
        format!("DROP SEQUENCE IF EXISTS {table}_epoch_seq"),
    ] {
        let _ = sqlx::query(&drop).execute(&pool).await;
    }
    pool.close().await;
    common::Cleanup::for_table(&table).run().await;
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}
