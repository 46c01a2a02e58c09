UPDATE {table}
    SET lease_until = clock_timestamp() + :lease_ms::bigint * interval '1 millisecond'
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps <> 2
    RETURNING 1 AS held
