SELECT
    -- Records released with their steps kept are counted apart, under the code 3: no
    -- claim holds them.
    IF(state = 0 AND steps = 2, 3, state) AS state, COUNT(*) AS n,
    GREATEST(0, {now} - MIN(claimed_ms)) AS oldest_ms
    FROM {table} GROUP BY 1
