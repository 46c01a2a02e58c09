(cur.state = 1 AND cur.expires_at <= EXCLUDED.claimed_at)
