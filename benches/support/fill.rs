//! Filling an idem table on PostgreSQL with completed records, and dropping it, for the
//! benches.

/// The integer in the environment variable `name`, or `default`.
pub fn env_or(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Inserts completed records `k<from>` .. `k<from + n - 1>` into `table` with the
/// expiry `expires` (SQL), then analyzes the table.
pub async fn fill(
    pool: &sqlx::PgPool,
    table: &str,
    from: i64,
    n: i64,
    expires: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    sqlx::query(&format!(
        "INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, lease_until, \
         created_at, claimed_at, expires_at, outcome) \
         SELECT '', 'bench', 'k' || g, 1, g, '\\x00'::bytea, now(), now(), now(), {expires}, \
         '\\x00'::bytea FROM generate_series($1::bigint, $2::bigint) g"
    ))
    .bind(from)
    .bind(from + n - 1)
    .execute(pool)
    .await?;
    sqlx::query(&format!("ANALYZE {table}"))
        .execute(pool)
        .await?;
    Ok(())
}

/// Drops `table` and the relations idem made beside it.
pub async fn drop_idem_table(
    pool: &sqlx::PgPool,
    table: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    for t in [
        format!("{table}_steps"),
        table.to_owned(),
        format!("{table}_meta"),
    ] {
        sqlx::query(&format!("DROP TABLE IF EXISTS {t}"))
            .execute(pool)
            .await?;
    }
    sqlx::query(&format!("DROP SEQUENCE IF EXISTS {table}_epoch_seq"))
        .execute(pool)
        .await?;
    Ok(())
}
