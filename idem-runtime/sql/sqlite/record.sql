UPDATE {table}
    SET state = 1, outcome = :outcome, outcome_is_err = :is_err, outcome_version = :version,
        expires_ms = CASE WHEN state = 0 THEN {now} + :retain_ms ELSE expires_ms END
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch
      AND ((state = 0 AND steps <> 2)
           OR (state = 1 AND outcome = :outcome AND outcome_is_err = :is_err
               AND outcome_version = :version))
    RETURNING 1 AS held
