SELECT state, count(*) AS n,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - min(claimed_at)) * 1000)::bigint)
            AS oldest_ms
    FROM {table} GROUP BY state
