DELETE FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch
        AND (state IN (1, 2) OR (state = 0 AND lease_until_ms <= {now}))
    RETURNING 1 AS held
