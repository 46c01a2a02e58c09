-- Deletes by physical address without locking first: a lock before the delete writes
-- each row twice. The wait limit (transaction-local) makes a row held by a claim end
-- this statement instead of waiting; the engine then purges with purge_locked.sql.
-- The steps of the records picked go too: an expired record's steps are dead even if a
-- claim takes the record first (its new life does not show them), and a step that new
-- life records has a higher epoch than the record as picked.
WITH wait_limit AS MATERIALIZED (SELECT set_config('lock_timeout', '100ms', true)),
-- Completed records past their retention and records released with their steps past
-- theirs, each kind read through its partial index on expires_at.
picked AS MATERIALIZED (
    SELECT * FROM (
        (SELECT ctid, scope, name, key, epoch, steps, expires_at FROM {table}
         WHERE state = 1 AND expires_at <= now()
         ORDER BY expires_at LIMIT :limit)
        UNION ALL
        (SELECT ctid, scope, name, key, epoch, steps, expires_at FROM {table}
         WHERE state = 0 AND steps = 2 AND expires_at <= now()
         ORDER BY expires_at LIMIT :limit)
    ) AS due ORDER BY expires_at LIMIT :limit
), steps_gone AS (
    DELETE FROM {steps} AS s USING picked AS p
    WHERE p.steps <> 0 AND s.scope = p.scope AND s.name = p.name AND s.key = p.key
      AND s.epoch <= p.epoch AND EXISTS (SELECT FROM wait_limit)
)
DELETE FROM {table}
    WHERE ctid = ANY(ARRAY(SELECT ctid FROM picked))
      AND (state = 1 OR (state = 0 AND steps = 2)) AND expires_at <= now()
      AND EXISTS (SELECT FROM wait_limit)
