-- idem: new claims counted across instances (PostgreSQL). Idempotent: safe to run again.
--
-- One row per key of a shared claim limit (`ClaimLimit::shared`), the key a digest:
-- `tat_us` is the GCRA's theoretical arrival time, in µs since the epoch by the
-- server's clock. A row whose time has passed holds a whole allowance, as a missing
-- row does, so purge deletes it.
CREATE TABLE IF NOT EXISTS idem_operations_claim_limits (
    limit_key TEXT   PRIMARY KEY,
    tat_us    BIGINT NOT NULL
);
