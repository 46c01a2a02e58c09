DELETE FROM {table} WHERE rowid IN (
    SELECT rowid FROM {table} WHERE state = 1 AND expires_ms <= :now_ms LIMIT :limit)
