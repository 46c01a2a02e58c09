-- Skips rows another transaction holds, at the cost of a lock write per row. The steps
-- of the records picked go too, as in purge.sql.
-- Each kind through its own partial index; a locking clause may not sit in a UNION.
WITH done AS MATERIALIZED (
    SELECT ctid, scope, name, key, epoch, steps FROM {table}
    WHERE state = 1 AND expires_at <= now()
    ORDER BY expires_at LIMIT :limit FOR UPDATE SKIP LOCKED
), released AS MATERIALIZED (
    SELECT ctid, scope, name, key, epoch, steps FROM {table}
    WHERE state = 0 AND steps = 2 AND expires_at <= now()
    ORDER BY expires_at LIMIT :limit FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT * FROM done UNION ALL SELECT * FROM released
), steps_gone AS (
    DELETE FROM {steps} AS s USING picked AS p
    WHERE p.steps <> 0 AND s.scope = p.scope AND s.name = p.name AND s.key = p.key
      AND s.epoch <= p.epoch
)
DELETE FROM {table}
    WHERE ctid = ANY(ARRAY(SELECT ctid FROM picked))
      AND (state = 1 OR (state = 0 AND steps = 2)) AND expires_at <= now()
