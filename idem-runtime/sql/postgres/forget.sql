WITH upd AS (
    DELETE FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch
        AND (state IN (1, 2) OR (state = 0 AND lease_until <= {now}))
    RETURNING scope, name, key, steps, waiters
), steps_gone AS (
    DELETE FROM {steps} AS s USING upd AS u
    WHERE u.steps <> 0 AND s.scope = u.scope AND s.name = u.name AND s.key = u.key
), woke AS (
    SELECT pg_notify('idem_wake', :payload) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke
