SELECT scope, name, key, state, epoch,
        greatest(0, (EXTRACT(EPOCH FROM clock_timestamp() - claimed_at) * 1000)::bigint)
            AS age_ms
    FROM {table}
    WHERE (:state::smallint IS NULL OR state = :state)
      AND (:op_name::text IS NULL OR name = :op_name)
      AND (:op_scope::text IS NULL OR scope = :op_scope)
      AND (:older_ms::bigint IS NULL
           OR claimed_at <= clock_timestamp() - :older_ms::bigint * interval '1 millisecond')
      AND (:newer_ms::bigint IS NULL
           OR claimed_at >= clock_timestamp() - :newer_ms::bigint * interval '1 millisecond')
    ORDER BY CASE WHEN :newest::boolean THEN claimed_at END DESC, claimed_at, scope, name, key
    LIMIT :limit
