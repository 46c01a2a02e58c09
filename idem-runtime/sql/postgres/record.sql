WITH upd AS (
    UPDATE {table}
    SET state = 1, outcome = :outcome, outcome_is_err = :is_err, outcome_version = :version,
        expires_at = CASE WHEN state = 0
                          THEN clock_timestamp() + :retain_ms::bigint * interval '1 millisecond'
                          ELSE expires_at END
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch
      AND (state = 0 OR (state = 1 AND outcome = :outcome AND outcome_is_err = :is_err
                         AND outcome_version = :version))
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', :payload) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke
