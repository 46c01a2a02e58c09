((cur.state = 1 OR (cur.state = 0 AND cur.steps = 2)) AND cur.expires_at <= EXCLUDED.claimed_at)
