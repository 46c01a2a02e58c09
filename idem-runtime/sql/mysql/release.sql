DELETE t, s FROM {table} AS t
    LEFT JOIN {steps} AS s
        ON t.steps = 3 AND s.scope = t.scope AND s.name = t.name AND s.`key` = t.`key`
    WHERE t.scope = :scope AND t.name = :name AND t.`key` = :key AND t.epoch = :epoch
      AND t.state = 0 AND t.steps IN (0, 3);
-- or else
UPDATE {table} SET steps = 2, lease_until_ms = {now}, expires_ms = {now} + :retain_ms
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state = 0
      AND steps = 1
