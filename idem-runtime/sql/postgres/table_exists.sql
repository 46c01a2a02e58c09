SELECT 1 AS present FROM information_schema.tables
    WHERE table_schema = COALESCE(:schema::text, current_schema()) AND table_name = :table_name
