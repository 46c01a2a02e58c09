DELETE FROM {table} WHERE state = 1 AND expires_ms <= {now} ORDER BY expires_ms LIMIT :limit
