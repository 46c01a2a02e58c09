DELETE FROM {bookkeeping} WHERE table_name = :table_name
