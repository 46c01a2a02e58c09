(state = 1 AND expires_ms <= VALUES(claimed_ms))
