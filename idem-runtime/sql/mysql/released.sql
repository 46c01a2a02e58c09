(state = 0 AND steps = 2 AND fingerprint = VALUES(fingerprint))
