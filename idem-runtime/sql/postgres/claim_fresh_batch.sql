-- Group commit: the claim of claim_fresh.sql for every row of the arrays, in one
-- statement and one transaction: a plain insert of each key with no record yet. `ord`
-- (1-based) says which request an inserted row answers; a request with no row found its
-- key taken, and claim.sql decides it. Keys are distinct within a batch and inserted in
-- key order, so batches that share keys wait on one another in one order.
WITH input AS (
    SELECT * FROM unnest(:scopes::text[], :names::text[], :keys::text[], :fps::bytea[],
        :lease_mss::bigint[]) WITH ORDINALITY AS i(scope, name, key, fp, lease_ms, ord)
), ins AS (
    INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, taken_over,
        lease_until, created_at, claimed_at, expires_at, outcome, outcome_is_err,
        outcome_version, waiters)
    SELECT i.scope, i.name, i.key, 0, {next_epoch}, i.fp, false,
        n.now + i.lease_ms * interval '1 millisecond', n.now, n.now, NULL, NULL, false, 0, false
    FROM input AS i CROSS JOIN (SELECT clock_timestamp() AS now) AS n
    ORDER BY i.scope, i.name, i.key
    ON CONFLICT (scope, name, key) DO NOTHING
    RETURNING scope, name, key, epoch
)
SELECT i.ord, ins.epoch
FROM input AS i
JOIN ins ON ins.scope = i.scope AND ins.name = i.name AND ins.key = i.key
