-- Completed records past their retention and records released with their steps past
-- theirs (only those have an expiry among records in progress), in the order of the
-- purge index on (state, expires_ms), so a batch reads no more of it than it deletes.
-- Their steps go first; a record whose steps are left waits for a later batch.
DELETE s FROM {steps} AS s
    JOIN (SELECT scope, name, `key`, epoch FROM {table}
          WHERE state IN (0, 1) AND expires_ms <= {now} AND (state = 1 OR steps = 2)
            AND steps <> 0
          ORDER BY state, expires_ms LIMIT :limit) AS p
        ON s.scope = p.scope AND s.name = p.name AND s.`key` = p.`key` AND s.epoch <= p.epoch;
DELETE FROM {table}
    WHERE state IN (0, 1) AND expires_ms <= {now} AND (state = 1 OR steps = 2)
      AND (steps = 0 OR NOT EXISTS (SELECT 1 FROM {steps} AS s
                                    WHERE s.scope = {table}.scope AND s.name = {table}.name
                                      AND s.`key` = {table}.`key`))
    ORDER BY state, expires_ms LIMIT :limit
