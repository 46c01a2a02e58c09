UPDATE {meta} SET key_mode = :mode WHERE id = 0 AND key_mode IS NULL
