-- idem: steps, several effects of one operation each recorded once (SQLite). Idempotent
-- as idem applies it: SQLite has no `ADD COLUMN IF NOT EXISTS`, so idem skips the
-- `ALTER TABLE` where the column exists; run by hand, run that statement once.
--
-- Whether the record has steps, in its current life (a record that completed, expired
-- and was claimed afresh starts a new one): 0 none; 1 recorded; 2 recorded and released
-- (no lease: the next claim with the same fingerprint resumes at once); 3 none in this
-- life, but an earlier life's may be left, which the first step of this one deletes.
ALTER TABLE idem_operations ADD COLUMN steps INTEGER NOT NULL DEFAULT 0;

-- One row per recorded step, under its operation's (scope, name, key).
CREATE TABLE IF NOT EXISTS idem_operations_steps (
    -- the order steps were first recorded in
    seq             INTEGER PRIMARY KEY,
    scope           TEXT    NOT NULL,
    name            TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    label           TEXT    NOT NULL,
    -- the epoch of the attempt that recorded it
    epoch           INTEGER NOT NULL,
    -- the store's clock, unix milliseconds
    recorded_ms     INTEGER NOT NULL,
    -- the step's value (JSON)
    outcome         BLOB    NOT NULL,
    outcome_is_err  INTEGER NOT NULL,
    outcome_version INTEGER NOT NULL,
    UNIQUE (scope, name, key, label)
);

-- Steps go with their record, however it is deleted (release, resolve, forget, purge).
CREATE TRIGGER IF NOT EXISTS idem_operations_steps_del AFTER DELETE ON idem_operations
    WHEN OLD.steps <> 0
BEGIN
    DELETE FROM idem_operations_steps
        WHERE scope = OLD.scope AND name = OLD.name AND key = OLD.key;
END;
