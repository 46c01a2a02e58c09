SELECT state, epoch, fingerprint = :fp AS same_fingerprint,
        COALESCE(state = 1 AND expires_at <= clock_timestamp(), false) AS expired,
        (state = 0 AND lease_until <= clock_timestamp()) AS lapsed,
        greatest(0, (EXTRACT(EPOCH FROM lease_until - clock_timestamp()) * 1000)::bigint)
            AS retry_after_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = :scope AND name = :name AND key = :key
