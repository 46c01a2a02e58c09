INSERT INTO {table} (scope, name, key, state, epoch, fingerprint,
        taken_over, lease_until, created_at, claimed_at)
    SELECT :scope, :name, :key, 0, {next_epoch}, :fp, false,
        n.now + :lease_ms::bigint * interval '1 millisecond', n.now, n.now
    FROM (SELECT clock_timestamp() AS now) AS n
    ON CONFLICT (scope, name, key) DO NOTHING
    RETURNING epoch
