-- idem: the operations table (MySQL/MariaDB, InnoDB), one row per operation (scope, name,
-- key), its epoch counter and the key mode the table was created with. Idempotent: safe
-- to run again. idem renames `idem_operations` (and its companions) to the configured
-- table when it applies this file.
--
-- Scope, name and key are VARBINARY: compared byte for byte (no collation folds `A` into
-- `a`), at most 255 bytes each as idem caps them, so the primary key (765 bytes) fits
-- InnoDB's index limit under every row format.
CREATE TABLE IF NOT EXISTS idem_operations (
    scope           VARBINARY(255) NOT NULL,
    name            VARBINARY(255) NOT NULL,
    `key`           VARBINARY(255) NOT NULL,
    -- 0 IN_PROGRESS, 1 COMPLETED, 2 UNKNOWN
    state           TINYINT        NOT NULL,
    -- fences record/release/renew/resolve to the claim that made it
    epoch           BIGINT         NOT NULL,
    -- SHA-256 of the request, bound at first claim
    fingerprint     BINARY(32)     NOT NULL,
    -- random per claim attempt: the claim's read compares it to tell "I claimed" from
    -- "I saw someone else's row"
    token           BIGINT         NOT NULL,
    -- 1 when the current epoch was claimed by taking over a lapsed lease
    taken_over      TINYINT        NOT NULL DEFAULT 0,
    -- times are the database's clock, unix milliseconds
    lease_until_ms  BIGINT         NOT NULL,
    created_ms      BIGINT         NOT NULL,
    claimed_ms      BIGINT         NOT NULL,
    expires_ms      BIGINT         NULL,
    -- the recorded outcome (JSON), only when COMPLETED
    outcome         LONGBLOB       NULL,
    outcome_is_err  TINYINT        NOT NULL DEFAULT 0,
    outcome_version INT            NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, name, `key`),
    -- purge: COMPLETED records past their retention
    KEY idem_operations_purge_idx (state, expires_ms),
    -- stats and list: the oldest IN_PROGRESS and UNKNOWN records (stuck claims)
    KEY idem_operations_stuck_idx (state, claimed_ms)
) ENGINE = InnoDB;

-- Epochs that never repeat: every claim inserts a row here and takes its AUTO_INCREMENT
-- value (then deletes the row), so a fence identifies one claim for all time, even after
-- its record was released, resolved or purged. InnoDB keeps the counter across restarts
-- (MySQL 8.0, MariaDB 10.2.4 and later).
CREATE TABLE IF NOT EXISTS idem_operations_epoch_seq (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS idem_operations_meta (
    id       TINYINT      NOT NULL PRIMARY KEY,
    -- how keys and scopes are stored: 'plain' or 'hmac-sha256:<check>'; NULL until the
    -- first open records it
    key_mode VARCHAR(255) NULL
) ENGINE = InnoDB;

INSERT INTO idem_operations_meta (id, key_mode) VALUES (0, NULL) ON DUPLICATE KEY UPDATE id = id;
