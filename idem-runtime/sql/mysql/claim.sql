INSERT INTO {table} (scope, name, `key`, state, epoch, fingerprint, token, taken_over,
        lease_until_ms, created_ms, claimed_ms, expires_ms, outcome, outcome_is_err,
        outcome_version)
    VALUES (:scope, :name, :key, 0, 0, :fp, :token, 0, {now} + :lease_ms, {now},
        {now}, NULL, NULL, 0, 0)
    ON DUPLICATE KEY UPDATE
        token = IF({expired} OR {lapsed} OR {released}, VALUES(token), token),
        epoch = IF(token = VALUES(token) AND (state = 1 OR steps = 2 OR NOT :to_unknown),
                   VALUES(epoch), epoch),
        fingerprint = IF(token = VALUES(token) AND state = 1, VALUES(fingerprint), fingerprint),
        taken_over = IF(token = VALUES(token),
                        IF(state = 1 OR steps = 2, 0, IF(:to_unknown, taken_over, 1)), taken_over),
        lease_until_ms = IF(token = VALUES(token) AND (state = 1 OR steps = 2 OR NOT :to_unknown),
                            VALUES(lease_until_ms), lease_until_ms),
        created_ms = IF(token = VALUES(token) AND state = 1, VALUES(created_ms), created_ms),
        claimed_ms = IF(token = VALUES(token) AND (state = 1 OR steps = 2 OR NOT :to_unknown),
                        VALUES(claimed_ms), claimed_ms),
        expires_ms = IF(token = VALUES(token) AND state = 1, NULL, expires_ms),
        outcome = IF(token = VALUES(token) AND state = 1, NULL, outcome),
        outcome_is_err = IF(token = VALUES(token) AND state = 1, 0, outcome_is_err),
        outcome_version = IF(token = VALUES(token) AND state = 1, 0, outcome_version),
        steps = IF(token = VALUES(token) AND state = 1, IF(steps = 0, 0, 3), steps),
        state = IF(token = VALUES(token), IF(state = 1 OR steps = 2 OR NOT :to_unknown, 0, 2),
                   state);
INSERT INTO {epoch_seq} (id)
    SELECT NULL FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND token = :token AND epoch = 0;
UPDATE {table} SET epoch = {next_epoch}, steps = IF(steps = 2, 1, steps)
    WHERE scope = :scope AND name = :name AND `key` = :key AND token = :token AND epoch = 0;
DELETE FROM {epoch_seq} WHERE id = LAST_INSERT_ID();
SELECT token = :token AS mine, state, epoch, fingerprint = :fp AS same_fingerprint, taken_over,
        steps = 1 AS resume, GREATEST(0, lease_until_ms - {now}) AS retry_after_ms,
        IF(fingerprint = :fp, outcome, NULL) AS outcome, outcome_is_err, outcome_version
    FROM {table} WHERE scope = :scope AND name = :name AND `key` = :key FOR UPDATE
