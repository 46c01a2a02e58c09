SELECT scope, name, key, state, epoch, fingerprint, taken_over, lease_until,
    created_at, claimed_at, expires_at, outcome, outcome_is_err, outcome_version, waiters,
    steps, (SELECT key_mode FROM {meta} WHERE id = 0) AS key_mode,
    (SELECT last_value FROM {epoch_seq}) AS last_epoch,
    EXISTS (SELECT seq, scope, name, key, label, epoch, recorded_at, outcome, outcome_is_err,
            outcome_version FROM {steps} WHERE false) AS steps_table
    FROM {table} LIMIT 0
