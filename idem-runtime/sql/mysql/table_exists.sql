SELECT 1 AS present FROM information_schema.tables
    WHERE table_schema = DATABASE() AND table_name = :table_name
