SELECT version FROM {bookkeeping} WHERE table_name = :table_name
