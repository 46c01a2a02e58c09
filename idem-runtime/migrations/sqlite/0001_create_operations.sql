-- idem: the operations table (SQLite), one row per operation (scope, name, key).
-- Idempotent: safe to run again. idem renames `idem_operations` (and its indexes) to the
-- configured table when it applies this file.
CREATE TABLE IF NOT EXISTS idem_operations (
    scope           TEXT    NOT NULL,
    name            TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    -- 0 IN_PROGRESS, 1 COMPLETED, 2 UNKNOWN
    state           INTEGER NOT NULL CHECK (state IN (0, 1, 2)),
    -- fences record/release/renew/resolve to the claim that made it
    epoch           INTEGER NOT NULL,
    -- SHA-256 of the request, bound at first claim
    fingerprint     BLOB    NOT NULL,
    -- random per claim attempt: the claim upsert compares it to tell "I claimed" from
    -- "I saw someone else's row", since RETURNING only shows the row after the statement
    token           INTEGER NOT NULL,
    -- 1 when the current epoch was claimed by taking over a lapsed lease
    taken_over      INTEGER NOT NULL DEFAULT 0,
    -- times are the store's clock, unix milliseconds
    lease_until_ms  INTEGER NOT NULL,
    created_ms      INTEGER NOT NULL,
    claimed_ms      INTEGER NOT NULL,
    expires_ms      INTEGER,
    -- the recorded outcome (JSON), only when COMPLETED
    outcome         BLOB,
    outcome_is_err  INTEGER NOT NULL DEFAULT 0,
    outcome_version INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, name, key)
);

-- purge: COMPLETED records past their retention
CREATE INDEX IF NOT EXISTS idem_operations_purge_idx ON idem_operations (state, expires_ms);

-- stats and list: the oldest IN_PROGRESS and UNKNOWN records (stuck claims)
CREATE INDEX IF NOT EXISTS idem_operations_stuck_idx ON idem_operations (state, claimed_ms);
