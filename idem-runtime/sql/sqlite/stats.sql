SELECT
    -- Records released with their steps kept are counted apart, under the code 3: no
    -- claim holds them.
    CASE WHEN state = 0 AND steps = 2 THEN 3 ELSE state END AS state, count(*) AS n,
    max(0, {now} - min(claimed_ms)) AS oldest_ms
    FROM {table} GROUP BY 1
