WITH seen AS (
    SELECT state, epoch, fingerprint, taken_over, lease_until, expires_at, outcome,
        outcome_is_err, outcome_version, steps, clock_timestamp() AS now
    FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key
), ins AS (
    INSERT INTO {table} AS cur (scope, name, key, state, epoch, fingerprint, taken_over,
        lease_until, created_at, claimed_at, expires_at, outcome, outcome_is_err,
        outcome_version, waiters)
    SELECT :scope, :name, :key, 0, {next_epoch}, :fp, false, n.now + :lease_ms::bigint * interval '1 millisecond',
        n.now, n.now, NULL, NULL, false, 0, false
    FROM (SELECT clock_timestamp() AS now) AS n
    WHERE NOT EXISTS (
        SELECT 1 FROM seen
        WHERE NOT ((state = 0 AND (lease_until <= now OR steps = 2) AND fingerprint = :fp)
                   OR ((state = 1 OR (state = 0 AND steps = 2)) AND expires_at <= now)))
    -- claim_conflict.sql: an existing row is taken only if its record expired, or its
    -- lease lapsed or was released under the same fingerprint.
    {claim_conflict}
    RETURNING true AS mine, false AS stale, cur.state, cur.epoch,
        true AS same_fingerprint, cur.taken_over, cur.steps = 1 AS resume,
        0::bigint AS retry_after_ms, cur.outcome, cur.outcome_is_err, cur.outcome_version
)
SELECT mine, stale, state, epoch, same_fingerprint, taken_over, resume, retry_after_ms,
    outcome, outcome_is_err, outcome_version
FROM ins
UNION ALL
SELECT false, (state = 0 AND (lease_until <= now OR steps = 2) AND fingerprint = :fp)
        OR ((state = 1 OR (state = 0 AND steps = 2)) AND expires_at <= now),
    state, epoch, fingerprint = :fp, taken_over, false,
    greatest(0, (EXTRACT(EPOCH FROM lease_until - now) * 1000)::bigint),
    CASE WHEN fingerprint = :fp THEN outcome END, outcome_is_err, outcome_version
FROM seen
WHERE NOT EXISTS (SELECT 1 FROM ins)
