-- idem's own migration bookkeeping, in the table's schema, one row per (table, version);
-- never sqlx's `_sqlx_migrations`, which belongs to the application.
CREATE TABLE IF NOT EXISTS {bookkeeping} (
    table_name TEXT        NOT NULL,
    version    INTEGER     NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (table_name, version)
)
