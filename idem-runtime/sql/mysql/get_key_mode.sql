SELECT key_mode FROM {meta} WHERE id = 0
