INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, token,
        taken_over, lease_until_ms, created_ms, claimed_ms)
    VALUES (:scope, :name, :key, 0, {next_epoch}, :fp, 0, 0, {now} + :lease_ms, {now}, {now})
    ON CONFLICT (scope, name, key) DO NOTHING
    RETURNING epoch
