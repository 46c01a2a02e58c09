-- Completed records past their retention, and records released with their steps past
-- theirs; each kind picked through the purge index on (state, expires_ms).
DELETE FROM {table} WHERE rowid IN (
    SELECT rowid FROM (SELECT rowid FROM {table}
                       WHERE state = 1 AND expires_ms <= :now_ms LIMIT :limit)
    UNION ALL
    SELECT rowid FROM (SELECT rowid FROM {table}
                       WHERE state = 0 AND expires_ms <= :now_ms AND steps = 2 LIMIT :limit))
