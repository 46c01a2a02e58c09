INSERT INTO {bookkeeping} (table_name, version, applied_ms) VALUES (:table_name, :version, {now})
