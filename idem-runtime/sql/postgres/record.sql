-- The record alone: a plain update, lighter for the server than one that also sends
-- the wake-up (wake.sql follows it, only where a caller waits).
UPDATE {table}
SET state = 1, outcome = :outcome, outcome_is_err = :is_err, outcome_version = :version,
    expires_at = CASE WHEN state = 0
                      THEN clock_timestamp() + :retain_ms::bigint * interval '1 millisecond'
                      ELSE expires_at END
WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch
  AND ((state = 0 AND steps <> 2)
       OR (state = 1 AND outcome = :outcome AND outcome_is_err = :is_err
           AND outcome_version = :version))
RETURNING 1::bigint AS held, waiters
