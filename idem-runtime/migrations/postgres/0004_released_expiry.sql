-- idem: records released with their steps expire (PostgreSQL). Idempotent: safe to run
-- again.
--
-- A record released with its steps (`steps = 2`) is kept until `expires_at`, the
-- operation's retention counted from the release; purge reads the ones past it here.
CREATE INDEX IF NOT EXISTS idem_operations_released_idx
    ON idem_operations (expires_at) WHERE state = 0 AND steps = 2;
