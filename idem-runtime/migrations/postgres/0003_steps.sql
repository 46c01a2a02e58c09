-- idem: steps, several effects of one operation each recorded once (PostgreSQL).
-- Idempotent: safe to run again.
--
-- Whether the record has steps, in its current life (a record that completed, expired
-- and was claimed afresh starts a new one): 0 none; 1 recorded; 2 recorded and released
-- (no lease: the next claim with the same fingerprint resumes at once); 3 none in this
-- life, but an earlier life's may be left, which the first step of this one deletes.
ALTER TABLE idem_operations ADD COLUMN IF NOT EXISTS steps SMALLINT NOT NULL DEFAULT 0;

-- One row per recorded step, under its operation's (scope, name, key). Deleted with
-- their record by the statements that delete it.
CREATE TABLE IF NOT EXISTS idem_operations_steps (
    scope           TEXT        NOT NULL,
    name            TEXT        NOT NULL,
    key             TEXT        NOT NULL,
    label           TEXT        NOT NULL,
    -- the order steps were first recorded in
    seq             BIGINT      GENERATED ALWAYS AS IDENTITY,
    -- the epoch of the attempt that recorded it
    epoch           BIGINT      NOT NULL,
    -- the store's clock (clock_timestamp())
    recorded_at     TIMESTAMPTZ NOT NULL,
    -- the step's value (JSON)
    outcome         BYTEA       NOT NULL,
    outcome_is_err  BOOLEAN     NOT NULL,
    outcome_version INTEGER     NOT NULL,
    PRIMARY KEY (scope, name, key, label)
);
