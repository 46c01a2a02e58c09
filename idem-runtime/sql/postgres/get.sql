SELECT state, epoch,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - claimed_at) * 1000)::bigint)
            AS age_ms,
        greatest(0, (EXTRACT(EPOCH FROM lease_until - clock_timestamp()) * 1000)::bigint)
            AS lease_ms,
        CASE WHEN expires_at IS NOT NULL THEN
            greatest(0, (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000)::bigint)
        END AS expires_ms,
        outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = :scope AND name = :name AND key = :key
