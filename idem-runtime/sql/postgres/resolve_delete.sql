-- As release.sql: a record with steps stays, released, for the next call to resume.
WITH kept AS (
    UPDATE {table} SET state = 0, steps = 2, lease_until = clock_timestamp(),
        expires_at = clock_timestamp() + :retain_ms::bigint * interval '1 millisecond'
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state IN (0, 2)
      AND steps IN (1, 2)
    RETURNING waiters
), gone AS (
    DELETE FROM {table}
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state IN (0, 2)
      AND steps IN (0, 3)
    RETURNING scope, name, key, steps, waiters
), earlier AS (
    DELETE FROM {steps} AS s USING gone AS g
    WHERE g.steps = 3 AND s.scope = g.scope AND s.name = g.name AND s.key = g.key
), upd AS (
    SELECT waiters FROM kept UNION ALL SELECT waiters FROM gone
), woke AS (
    SELECT pg_notify('idem_wake', :payload) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke
