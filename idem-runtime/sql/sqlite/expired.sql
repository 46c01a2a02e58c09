(cur.state = 1 AND cur.expires_ms <= excluded.claimed_ms)
