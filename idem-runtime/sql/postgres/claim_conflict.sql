    ON CONFLICT (scope, name, key) DO UPDATE SET
        state = CASE WHEN {expired} OR {released} OR NOT :to_unknown THEN 0 ELSE 2 END,
        epoch = CASE WHEN {expired} OR {released} OR NOT :to_unknown THEN EXCLUDED.epoch
                     ELSE cur.epoch END,
        fingerprint = EXCLUDED.fingerprint,
        taken_over = CASE WHEN {expired} OR {released} THEN false WHEN :to_unknown THEN cur.taken_over
                          ELSE true END,
        lease_until = CASE WHEN {expired} OR {released} OR NOT :to_unknown THEN EXCLUDED.lease_until
                           ELSE cur.lease_until END,
        created_at = CASE WHEN {expired} THEN EXCLUDED.created_at ELSE cur.created_at END,
        claimed_at = CASE WHEN {expired} OR {released} OR NOT :to_unknown THEN EXCLUDED.claimed_at
                          ELSE cur.claimed_at END,
        expires_at = NULL,
        outcome = NULL,
        outcome_is_err = false,
        outcome_version = 0,
        waiters = CASE WHEN {expired} THEN false ELSE cur.waiters END,
        steps = CASE WHEN {expired} THEN CASE WHEN cur.steps = 0 THEN 0 ELSE 3 END
                     WHEN {released} THEN 1 ELSE cur.steps END
    WHERE {expired} OR {lapsed} OR {released}
