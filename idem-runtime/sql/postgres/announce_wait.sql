UPDATE {table} SET waiters = true
    WHERE scope = :scope AND name = :name AND key = :key AND state = 0 AND NOT waiters
