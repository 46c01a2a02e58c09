SELECT state, COUNT(*) AS n, GREATEST(0, {now} - MIN(claimed_ms)) AS oldest_ms
    FROM {table} GROUP BY state
