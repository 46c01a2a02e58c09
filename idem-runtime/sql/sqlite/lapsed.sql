(cur.state = 0 AND cur.lease_until_ms <= excluded.claimed_ms AND cur.fingerprint = excluded.fingerprint)
