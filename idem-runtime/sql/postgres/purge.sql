-- Deletes by physical address without locking first: a lock before the delete writes
-- each row twice. The wait limit (transaction-local) makes a row held by a claim end
-- this statement instead of waiting; the engine then purges with purge_locked.sql.
WITH wait_limit AS MATERIALIZED (SELECT set_config('lock_timeout', '100ms', true))
DELETE FROM {table}
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {table}
        WHERE state = 1 AND expires_at <= now()
        ORDER BY expires_at LIMIT :limit))
      AND state = 1 AND expires_at <= now()
      AND EXISTS (SELECT FROM wait_limit)
