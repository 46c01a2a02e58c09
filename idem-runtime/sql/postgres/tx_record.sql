UPDATE {table}
    SET state = 1, outcome = :outcome, outcome_is_err = :is_err, outcome_version = :version,
        expires_at = clock_timestamp() + :retain_ms::bigint * interval '1 millisecond'
    WHERE scope = :scope AND name = :name AND key = :key AND state = 0 AND epoch = :epoch
    RETURNING 1 AS held
