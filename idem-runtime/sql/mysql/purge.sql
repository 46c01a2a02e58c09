DELETE s FROM {steps} AS s
    JOIN (SELECT scope, name, `key`, epoch FROM {table}
          WHERE state = 1 AND expires_ms <= {now} AND steps <> 0
          ORDER BY expires_ms LIMIT :limit) AS p
        ON s.scope = p.scope AND s.name = p.name AND s.`key` = p.`key` AND s.epoch <= p.epoch;
DELETE FROM {table}
    WHERE state = 1 AND expires_ms <= {now}
      AND (steps = 0 OR NOT EXISTS (SELECT 1 FROM {steps} AS s
                                    WHERE s.scope = {table}.scope AND s.name = {table}.name
                                      AND s.`key` = {table}.`key`))
    ORDER BY expires_ms LIMIT :limit
