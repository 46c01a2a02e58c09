-- idem: the operations table (PostgreSQL), one row per operation (scope, name, key).
-- Idempotent: safe to run again. idem renames `idem_operations` (and its indexes) to the
-- configured table, schema-qualified if configured, when it applies this file.
CREATE TABLE IF NOT EXISTS idem_operations (
    scope           TEXT        NOT NULL,
    name            TEXT        NOT NULL,
    key             TEXT        NOT NULL,
    -- 0 IN_PROGRESS, 1 COMPLETED, 2 UNKNOWN
    state           SMALLINT    NOT NULL CHECK (state IN (0, 1, 2)),
    -- fences record/release/renew/resolve to the claim that made it
    epoch           BIGINT      NOT NULL,
    -- SHA-256 of the request, bound at first claim
    fingerprint     BYTEA       NOT NULL,
    -- true when the current epoch was claimed by taking over a lapsed lease
    taken_over      BOOLEAN     NOT NULL DEFAULT false,
    -- times are the store's clock (clock_timestamp())
    lease_until     TIMESTAMPTZ NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    claimed_at      TIMESTAMPTZ NOT NULL,
    expires_at      TIMESTAMPTZ,
    -- the recorded outcome (JSON), only when COMPLETED
    outcome         BYTEA,
    outcome_is_err  BOOLEAN     NOT NULL DEFAULT false,
    outcome_version INTEGER     NOT NULL DEFAULT 0,
    -- a caller is waiting: record/release/mark_unknown send NOTIFY idem_wake
    waiters         BOOLEAN     NOT NULL DEFAULT false,
    PRIMARY KEY (scope, name, key)
);

-- purge: COMPLETED records past their retention
CREATE INDEX IF NOT EXISTS idem_operations_purge_idx
    ON idem_operations (expires_at) WHERE state = 1;

-- stats and list: the oldest IN_PROGRESS and UNKNOWN records (stuck claims)
CREATE INDEX IF NOT EXISTS idem_operations_stuck_idx
    ON idem_operations (claimed_at) WHERE state IN (0, 2);
