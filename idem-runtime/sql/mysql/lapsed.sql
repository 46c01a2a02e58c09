(state = 0 AND lease_until_ms <= VALUES(claimed_ms) AND fingerprint = VALUES(fingerprint))
