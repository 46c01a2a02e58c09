SELECT s.label, s.epoch, max(0, {now} - s.recorded_ms) AS age_ms, s.outcome,
        s.outcome_is_err, s.outcome_version
    FROM {table} AS t
    JOIN {steps} AS s ON s.scope = t.scope AND s.name = t.name AND s.key = t.key
    WHERE t.scope = :scope AND t.name = :name AND t.key = :key AND t.state <> 1
      AND t.steps IN (1, 2)
    ORDER BY s.seq
