DELETE FROM {claim_limits}
    WHERE tat_us < (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint
