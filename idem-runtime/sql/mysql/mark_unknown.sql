UPDATE {table} SET state = 2
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state = 0
      AND steps <> 2
