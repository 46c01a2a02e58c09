WITH upd AS (
    UPDATE {table} SET state = 2
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps <> 2
    RETURNING waiters
), woke AS (
    SELECT pg_notify('idem_wake', :payload) FROM upd WHERE waiters
)
SELECT (SELECT count(*) FROM upd) AS held, (SELECT count(*) FROM woke) AS woke
