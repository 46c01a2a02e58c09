-- Skips rows another transaction holds, at the cost of a lock write per row.
DELETE FROM {table}
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {table}
        WHERE state = 1 AND expires_at <= now()
        ORDER BY expires_at LIMIT :limit FOR UPDATE SKIP LOCKED))
      AND state = 1 AND expires_at <= now()
