SELECT
    -- Records released with their steps kept are counted apart, under the code 3: no
    -- claim holds them.
    CASE WHEN state = 0 AND steps = 2 THEN 3 ELSE state END AS state, count(*) AS n,
    greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - min(claimed_at)) * 1000)::bigint)
        AS oldest_ms
    FROM {table} GROUP BY 1
