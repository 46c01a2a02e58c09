UPDATE {table}
    SET state = 0, epoch = {next_epoch}, fingerprint = :fp, taken_over = false,
        lease_until = clock_timestamp() + :lease_ms::bigint * interval '1 millisecond',
        created_at = clock_timestamp(),
        claimed_at = clock_timestamp(), expires_at = NULL, outcome = NULL,
        outcome_is_err = false, outcome_version = 0, waiters = false,
        steps = CASE WHEN steps = 0 THEN 0 ELSE 3 END
    WHERE scope = :scope AND name = :name AND key = :key AND state = 1
      AND expires_at <= clock_timestamp()
    RETURNING epoch
