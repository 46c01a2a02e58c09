DELETE FROM {table}
    WHERE (scope, name, key) IN (
        SELECT scope, name, key FROM {table}
        WHERE state = 1 AND expires_at <= now()
        LIMIT :limit FOR UPDATE SKIP LOCKED)
      AND state = 1 AND expires_at <= now()
