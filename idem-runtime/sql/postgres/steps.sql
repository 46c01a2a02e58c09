SELECT s.label, s.epoch,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - s.recorded_at) * 1000)::bigint)
            AS age_ms,
        s.outcome, s.outcome_is_err, s.outcome_version
    FROM {table} AS t
    JOIN {steps} AS s ON s.scope = t.scope AND s.name = t.name AND s.key = t.key
    WHERE t.scope = :scope AND t.name = :name AND t.key = :key AND t.state <> 1
      AND t.steps IN (1, 2)
    ORDER BY s.seq
