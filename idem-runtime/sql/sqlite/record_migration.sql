INSERT INTO {bookkeeping} (table_name, version, applied_at) VALUES (:table_name, :version, {now})
