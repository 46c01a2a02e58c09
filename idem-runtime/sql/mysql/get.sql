SELECT state, epoch, GREATEST(0, {now} - claimed_ms) AS age_ms,
        GREATEST(0, lease_until_ms - {now}) AS lease_ms,
        GREATEST(0, expires_ms - {now}) AS expires_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = :scope AND name = :name AND `key` = :key
