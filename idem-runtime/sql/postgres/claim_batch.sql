-- Group commit: the claim of claim.sql for every row of the arrays, in one statement and
-- one transaction. Keys are distinct within a batch and each row is decided alone, as
-- claim.sql decides it; `ord` (1-based) says which request a result row answers. A
-- request with no row raced a concurrent commit and is issued again, as in claim.sql.
-- Rows are inserted in key order, so batches that share keys lock them in one order.
WITH input AS (
    SELECT * FROM unnest(:scopes::text[], :names::text[], :keys::text[], :fps::bytea[],
        :lease_mss::bigint[]) WITH ORDINALITY AS i(scope, name, key, fp, lease_ms, ord)
), seen AS (
    SELECT i.ord, i.fp, t.state, t.epoch, t.fingerprint, t.taken_over, t.lease_until,
        t.expires_at, t.outcome, t.outcome_is_err, t.outcome_version, t.steps,
        clock_timestamp() AS now
    FROM input AS i
    JOIN {table} AS t ON t.scope = i.scope AND t.name = i.name AND t.key = i.key
), ins AS (
    INSERT INTO {table} AS cur (scope, name, key, state, epoch, fingerprint, taken_over,
        lease_until, created_at, claimed_at, expires_at, outcome, outcome_is_err,
        outcome_version, waiters)
    SELECT i.scope, i.name, i.key, 0, {next_epoch}, i.fp, false,
        n.now + i.lease_ms * interval '1 millisecond', n.now, n.now, NULL, NULL, false, 0, false
    FROM input AS i CROSS JOIN (SELECT clock_timestamp() AS now) AS n
    WHERE NOT EXISTS (
        SELECT 1 FROM seen AS s
        WHERE s.ord = i.ord
          AND NOT ((s.state = 0 AND (s.lease_until <= s.now OR s.steps = 2)
                    AND s.fingerprint = i.fp)
                   OR ((s.state = 1 OR (s.state = 0 AND s.steps = 2)) AND s.expires_at <= s.now)))
    ORDER BY i.scope, i.name, i.key
    -- claim_conflict.sql: an existing row is taken only if its record expired, or its
    -- lease lapsed or was released under the same fingerprint.
    {claim_conflict}
    RETURNING cur.scope, cur.name, cur.key, cur.state, cur.epoch, cur.taken_over,
        cur.steps = 1 AS resume, cur.outcome, cur.outcome_is_err, cur.outcome_version
), won AS (
    SELECT i.ord, ins.state, ins.epoch, ins.taken_over, ins.resume, ins.outcome,
        ins.outcome_is_err, ins.outcome_version
    FROM input AS i
    JOIN ins ON ins.scope = i.scope AND ins.name = i.name AND ins.key = i.key
)
SELECT ord, true AS mine, false AS stale, state, epoch, true AS same_fingerprint, taken_over,
    resume, 0::bigint AS retry_after_ms, outcome, outcome_is_err, outcome_version
FROM won
UNION ALL
SELECT s.ord, false,
    (s.state = 0 AND (s.lease_until <= s.now OR s.steps = 2) AND s.fingerprint = s.fp)
        OR ((s.state = 1 OR (s.state = 0 AND s.steps = 2)) AND s.expires_at <= s.now),
    s.state, s.epoch, s.fingerprint = s.fp, s.taken_over, false,
    greatest(0, (EXTRACT(EPOCH FROM s.lease_until - s.now) * 1000)::bigint),
    CASE WHEN s.fingerprint = s.fp THEN s.outcome END, s.outcome_is_err, s.outcome_version
FROM seen AS s
WHERE NOT EXISTS (SELECT 1 FROM won WHERE won.ord = s.ord)
