UPDATE {table}
    SET state = 1, outcome = :outcome, outcome_is_err = :is_err, outcome_version = :version,
        expires_ms = {now} + :retain_ms
    WHERE scope = :scope AND name = :name AND `key` = :key AND state = 0 AND epoch = :epoch
