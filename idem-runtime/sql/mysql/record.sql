UPDATE {table}
    SET expires_ms = IF(state = 0, {now} + :retain_ms, expires_ms), state = 1,
        outcome = :outcome, outcome_is_err = :is_err, outcome_version = :version
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch
      AND ((state = 0 AND steps <> 2)
           OR (state = 1 AND outcome = :outcome AND outcome_is_err = :is_err
               AND outcome_version = :version))
