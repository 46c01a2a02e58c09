SELECT state, epoch, fingerprint = :fp AS same_fingerprint,
        COALESCE(state = 1 AND expires_ms <= {now}, 0) AS expired,
        (state = 0 AND lease_until_ms <= {now}) AS lapsed,
        GREATEST(0, lease_until_ms - {now}) AS retry_after_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = :scope AND name = :name AND `key` = :key FOR UPDATE
