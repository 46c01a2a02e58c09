DELETE FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state = 0
