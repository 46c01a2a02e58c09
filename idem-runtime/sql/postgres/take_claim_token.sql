WITH clock AS (
    SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint AS us
), taken AS (
    INSERT INTO {claim_limits} AS l (limit_key, tat_us)
    SELECT :key, clock.us + :every_us FROM clock
    ON CONFLICT (limit_key) DO UPDATE
        SET tat_us = greatest(l.tat_us, (SELECT us FROM clock)) + :every_us
        WHERE greatest(l.tat_us, (SELECT us FROM clock)) + :every_us
            - (SELECT us FROM clock) <= :window_us
    RETURNING 0::bigint AS wait_us
)
SELECT wait_us FROM taken
UNION ALL
SELECT greatest(l.tat_us + :every_us - :window_us - clock.us, 1)
    FROM {claim_limits} AS l, clock
    WHERE l.limit_key = :key AND NOT EXISTS (SELECT 1 FROM taken)
