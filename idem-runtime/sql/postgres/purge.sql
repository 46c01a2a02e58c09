DELETE FROM {table}
    WHERE (scope, name, key) IN (
        SELECT scope, name, key FROM {table}
        WHERE state = 1 AND expires_at <= clock_timestamp()
        LIMIT :limit FOR UPDATE SKIP LOCKED)
      AND state = 1 AND expires_at <= clock_timestamp()
