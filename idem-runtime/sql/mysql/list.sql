SELECT CAST(scope AS CHAR) AS scope, CAST(name AS CHAR) AS name, CAST(`key` AS CHAR) AS `key`,
        state, epoch, GREATEST(0, {now} - claimed_ms) AS age_ms
    FROM {table}
    WHERE (:state IS NULL OR state = :state) AND (:op_name IS NULL OR name = :op_name)
      AND (:op_scope IS NULL OR scope = :op_scope)
      AND (:older_ms IS NULL OR claimed_ms <= {now} - :older_ms)
      AND (:newer_ms IS NULL OR claimed_ms >= {now} - :newer_ms)
    ORDER BY CASE WHEN :newest THEN claimed_ms END DESC, claimed_ms, scope, name, `key`
    LIMIT :limit
