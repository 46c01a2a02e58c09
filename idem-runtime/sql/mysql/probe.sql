SELECT scope, name, `key`, state, epoch, fingerprint, token, taken_over, lease_until_ms,
        created_ms, claimed_ms, expires_ms, outcome, outcome_is_err, outcome_version, steps,
        (SELECT key_mode FROM {meta} WHERE id = 0) AS key_mode,
        (SELECT MAX(id) FROM {epoch_seq}) AS last_epoch,
        EXISTS (SELECT seq, scope, name, `key`, label, epoch, recorded_ms, outcome,
                outcome_is_err, outcome_version FROM {steps} WHERE false) AS steps_table
    FROM {table} LIMIT 0
