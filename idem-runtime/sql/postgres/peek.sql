SELECT fingerprint = :fp AS same_fingerprint, CASE WHEN fingerprint = :fp THEN outcome END AS outcome,
        outcome_is_err, outcome_version
    FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key AND state = 1
      AND expires_at > clock_timestamp()
