SELECT scope, name, key, state, epoch, fingerprint, taken_over, lease_until,
    created_at, claimed_at, expires_at, outcome, outcome_is_err, outcome_version, waiters,
    (SELECT key_mode FROM {meta} WHERE id = 0) AS key_mode,
    (SELECT last_value FROM {epoch_seq}) AS last_epoch
    FROM {table} LIMIT 0
