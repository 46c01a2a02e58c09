SELECT steps FROM {table}
    -- The record's own lock before the join below reads it, which would take a shared
    -- lock: two steps of one operation written at once would then deadlock upgrading it.
    WHERE scope = :scope AND name = :name AND `key` = :key FOR UPDATE;
DELETE s FROM {steps} AS s
    JOIN {table} AS t ON t.scope = s.scope AND t.name = s.name AND t.`key` = s.`key`
    WHERE t.scope = :scope AND t.name = :name AND t.`key` = :key AND t.epoch = :epoch
      AND t.state = 0 AND t.steps = 3;
UPDATE {table} SET steps = 1
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state = 0
      AND steps <> 2;
INSERT INTO {steps} (scope, name, `key`, label, epoch, recorded_ms, outcome, outcome_is_err,
        outcome_version)
    SELECT scope, name, `key`, :label, epoch, {now}, :outcome, :is_err, :version FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state = 0
      AND steps = 1
    ON DUPLICATE KEY UPDATE epoch = VALUES(epoch), recorded_ms = VALUES(recorded_ms),
        outcome = VALUES(outcome), outcome_is_err = VALUES(outcome_is_err),
        outcome_version = VALUES(outcome_version)
