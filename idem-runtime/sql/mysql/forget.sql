DELETE t, s FROM {table} AS t
    LEFT JOIN {steps} AS s
        ON t.steps <> 0 AND s.scope = t.scope AND s.name = t.name AND s.`key` = t.`key`
    WHERE t.scope = :scope AND t.name = :name AND t.`key` = :key AND t.epoch = :epoch
        AND (t.state IN (1, 2) OR (t.state = 0 AND t.lease_until_ms <= {now}))
