-- The claim of a key with no record yet: a plain insert, where claim.sql also reads the
-- row and carries a conflict arm. No row back means the key exists; claim.sql decides.
-- A key that exists draws an epoch it does not use (the sequence is read before the
-- conflict is found): epochs stay unique and growing, and an existence check before
-- the insert, which spared the draw, cost a tenth of the statement.
INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, taken_over, lease_until,
    created_at, claimed_at, expires_at, outcome, outcome_is_err, outcome_version, waiters)
SELECT :scope, :name, :key, 0, {next_epoch}, :fp, false,
    n.now + :lease_ms::bigint * interval '1 millisecond', n.now, n.now, NULL, NULL, false, 0,
    false
FROM (SELECT clock_timestamp() AS now) AS n
ON CONFLICT (scope, name, key) DO NOTHING
RETURNING epoch
