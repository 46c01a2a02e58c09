SELECT scope, name, `key`, state, epoch, fingerprint, token, taken_over, lease_until_ms,
        created_ms, claimed_ms, expires_ms, outcome, outcome_is_err, outcome_version,
        (SELECT key_mode FROM {meta} WHERE id = 0) AS key_mode,
        (SELECT MAX(id) FROM {epoch_seq}) AS last_epoch
    FROM {table} LIMIT 0
