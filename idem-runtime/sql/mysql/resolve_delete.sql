DELETE FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state IN (0, 2)
