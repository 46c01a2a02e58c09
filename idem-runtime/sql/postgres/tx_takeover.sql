UPDATE {table}
    SET epoch = {next_epoch}, taken_over = true,
        lease_until = clock_timestamp() + :lease_ms::bigint * interval '1 millisecond',
        claimed_at = clock_timestamp(), steps = CASE WHEN steps = 2 THEN 1 ELSE steps END
    WHERE scope = :scope AND name = :name AND key = :key AND state = 0
      AND lease_until <= clock_timestamp() AND fingerprint = :fp
    RETURNING epoch
