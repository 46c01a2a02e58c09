INSERT INTO {table} AS cur (scope, name, key, state, epoch, fingerprint,
        token, taken_over, lease_until_ms, created_ms, claimed_ms, expires_ms, outcome,
        outcome_is_err, outcome_version)
    VALUES (:scope, :name, :key, 0, {next_epoch}, :fp, :token, 0, {now} + :lease_ms, {now}, {now}, NULL, NULL, 0, 0)
    ON CONFLICT (scope, name, key) DO UPDATE SET
        state = CASE WHEN {expired} OR {rerun} THEN 0 WHEN {to_unknown} THEN 2
                     ELSE cur.state END,
        epoch = CASE WHEN {expired} OR {rerun} THEN excluded.epoch ELSE cur.epoch END,
        fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE cur.fingerprint END,
        token = CASE WHEN {expired} OR {lapsed} OR {released} THEN excluded.token
                     ELSE cur.token END,
        taken_over = CASE WHEN {expired} OR {released} THEN 0 WHEN {rerun} THEN 1
                          ELSE cur.taken_over END,
        lease_until_ms = CASE WHEN {expired} OR {rerun} THEN excluded.lease_until_ms
                              ELSE cur.lease_until_ms END,
        created_ms = CASE WHEN {expired} THEN excluded.created_ms ELSE cur.created_ms END,
        claimed_ms = CASE WHEN {expired} OR {rerun} THEN excluded.claimed_ms
                          ELSE cur.claimed_ms END,
        expires_ms = CASE WHEN {expired} OR {released} THEN NULL ELSE cur.expires_ms END,
        outcome = CASE WHEN {expired} THEN NULL ELSE cur.outcome END,
        outcome_is_err = CASE WHEN {expired} THEN 0 ELSE cur.outcome_is_err END,
        outcome_version = CASE WHEN {expired} THEN 0 ELSE cur.outcome_version END,
        steps = CASE WHEN {expired} THEN CASE WHEN cur.steps = 0 THEN 0 ELSE 3 END
                     WHEN {released} THEN 1 ELSE cur.steps END
    RETURNING token = :token AS mine, state, epoch, fingerprint = :fp AS same_fingerprint,
        taken_over, steps = 1 AS resume, lease_until_ms - {now} AS retry_after_ms, outcome,
        outcome_is_err, outcome_version
