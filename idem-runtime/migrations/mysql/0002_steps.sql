-- idem: steps, several effects of one operation each recorded once (MySQL/MariaDB).
-- Idempotent: safe to run again.
--
-- Whether the record has steps, in its current life (a record that completed, expired
-- and was claimed afresh starts a new one): 0 none; 1 recorded; 2 recorded and released
-- (no lease: the next claim with the same fingerprint resumes at once); 3 none in this
-- life, but an earlier life's may be left, which the first step of this one deletes.
-- MySQL has no `ADD COLUMN IF NOT EXISTS` (MariaDB has), so the column is added by a
-- statement built only where it is missing. The table's name is compared without the
-- quotes idem gives it when it renames the table in this file.
SET @idem_add_steps = IF(
    (SELECT COUNT(*) FROM information_schema.columns
        WHERE table_schema = DATABASE()
          AND table_name = TRIM(BOTH '`' FROM 'idem_operations')
          AND column_name = 'steps') = 0,
    'ALTER TABLE idem_operations ADD COLUMN steps TINYINT NOT NULL DEFAULT 0',
    'DO 0');
PREPARE idem_add_steps FROM @idem_add_steps;
EXECUTE idem_add_steps;
DEALLOCATE PREPARE idem_add_steps;

-- One row per recorded step, under its operation's (scope, name, key). Deleted with
-- their record by the statements that delete it. DYNAMIC: the key (1020 bytes) is over
-- the older row formats' 767-byte index limit.
CREATE TABLE IF NOT EXISTS idem_operations_steps (
    -- the order steps were first recorded in
    seq             BIGINT         NOT NULL AUTO_INCREMENT,
    scope           VARBINARY(255) NOT NULL,
    name            VARBINARY(255) NOT NULL,
    `key`           VARBINARY(255) NOT NULL,
    label           VARBINARY(255) NOT NULL,
    -- the epoch of the attempt that recorded it
    epoch           BIGINT         NOT NULL,
    -- the database's clock, unix milliseconds
    recorded_ms     BIGINT         NOT NULL,
    -- the step's value (JSON)
    outcome         LONGBLOB       NOT NULL,
    outcome_is_err  TINYINT        NOT NULL,
    outcome_version INT            NOT NULL,
    PRIMARY KEY (scope, name, `key`, label),
    UNIQUE KEY idem_operations_steps_seq_idx (seq)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
