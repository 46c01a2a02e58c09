DELETE FROM {table}
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {table}
        WHERE state = 1 AND expires_at <= now()
        LIMIT :limit FOR UPDATE SKIP LOCKED))
      AND state = 1 AND expires_at <= now()
