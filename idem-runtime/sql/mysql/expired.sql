((state = 1 OR (state = 0 AND steps = 2)) AND expires_ms <= VALUES(claimed_ms))
