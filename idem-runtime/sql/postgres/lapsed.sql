(cur.state = 0 AND cur.lease_until <= EXCLUDED.claimed_at AND cur.fingerprint = EXCLUDED.fingerprint)
