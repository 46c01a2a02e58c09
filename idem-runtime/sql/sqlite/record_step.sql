DELETE FROM {steps}
    WHERE scope = :scope AND name = :name AND key = :key
      AND EXISTS (SELECT 1 FROM {table}
                  WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch
                    AND state = 0 AND steps = 3);
UPDATE {table} SET steps = 1
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps <> 2;
INSERT INTO {steps} (scope, name, key, label, epoch, recorded_ms, outcome, outcome_is_err,
        outcome_version)
    SELECT scope, name, key, :label, epoch, {now}, :outcome, :is_err, :version FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps = 1
    ON CONFLICT (scope, name, key, label) DO UPDATE SET
        epoch = excluded.epoch, recorded_ms = excluded.recorded_ms, outcome = excluded.outcome,
        outcome_is_err = excluded.outcome_is_err, outcome_version = excluded.outcome_version
    RETURNING 1 AS held
