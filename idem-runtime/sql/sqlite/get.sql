SELECT scope, name, key, state, epoch, max(0, {now} - claimed_ms) AS age_ms,
        max(0, lease_until_ms - {now}) AS lease_ms, max(0, expires_ms - {now}) AS expires_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = :scope AND name = :name AND key = :key
