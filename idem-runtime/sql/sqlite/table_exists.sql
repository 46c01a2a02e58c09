SELECT 1 AS present FROM sqlite_master WHERE type = 'table' AND name = :table_name
