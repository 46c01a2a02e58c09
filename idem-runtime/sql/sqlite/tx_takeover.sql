UPDATE {table}
    SET epoch = {next_epoch}, token = 0, taken_over = 1, lease_until_ms = {now} + :lease_ms,
        claimed_ms = {now}, steps = CASE WHEN steps = 2 THEN 1 ELSE steps END
    WHERE scope = :scope AND name = :name AND key = :key AND state = 0 AND lease_until_ms <= {now}
      AND fingerprint = :fp
    RETURNING epoch
