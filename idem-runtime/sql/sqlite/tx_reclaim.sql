UPDATE {table}
    SET state = 0, epoch = {next_epoch}, fingerprint = :fp, token = 0, taken_over = 0,
        lease_until_ms = {now} + :lease_ms, created_ms = {now}, claimed_ms = {now}, expires_ms = NULL,
        outcome = NULL, outcome_is_err = 0, outcome_version = 0,
        steps = CASE WHEN steps = 0 THEN 0 ELSE 3 END
    WHERE scope = :scope AND name = :name AND key = :key AND state = 1 AND expires_ms <= {now}
    RETURNING epoch
