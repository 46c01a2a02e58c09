SELECT fingerprint = :fp AS same_fingerprint, IF(fingerprint = :fp, outcome, NULL) AS outcome,
        outcome_is_err, outcome_version
    FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND state = 1 AND expires_ms > {now}
