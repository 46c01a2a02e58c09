(cur.state = 0 AND cur.steps = 2 AND cur.fingerprint = excluded.fingerprint)
