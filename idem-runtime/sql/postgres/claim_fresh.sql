-- The claim of a key with no record yet: a plain insert, where claim.sql also reads the
-- row and carries a conflict arm. No row back means the key exists; claim.sql decides.
-- The existence check keeps a key that exists from drawing an epoch it will not use.
INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, taken_over, lease_until,
    created_at, claimed_at, expires_at, outcome, outcome_is_err, outcome_version, waiters)
SELECT :scope, :name, :key, 0, {next_epoch}, :fp, false,
    n.now + :lease_ms::bigint * interval '1 millisecond', n.now, n.now, NULL, NULL, false, 0,
    false
FROM (SELECT clock_timestamp() AS now) AS n
WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE scope = :scope AND name = :name AND key = :key)
ON CONFLICT (scope, name, key) DO NOTHING
RETURNING epoch
