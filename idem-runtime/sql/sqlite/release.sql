UPDATE {table} SET steps = 2, lease_until_ms = {now}, expires_ms = {now} + :retain_ms
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps = 1
    RETURNING 1 AS held;
DELETE FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps IN (0, 3)
    RETURNING 1 AS held
