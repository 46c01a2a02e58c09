UPDATE {table} SET lease_until_ms = {now} + :lease_ms
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = :epoch AND state = 0
      AND steps <> 2
