SELECT state, count(*) AS n, max(0, {now} - min(claimed_ms)) AS oldest_ms
    FROM {table} GROUP BY state
