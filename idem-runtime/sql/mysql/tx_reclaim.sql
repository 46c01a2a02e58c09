INSERT INTO {epoch_seq} (id) VALUES (NULL);
DELETE FROM {epoch_seq} WHERE id = LAST_INSERT_ID();
UPDATE {table}
    SET state = 0, epoch = {next_epoch}, fingerprint = :fp, token = 0, taken_over = 0,
        lease_until_ms = {now} + :lease_ms, created_ms = {now}, claimed_ms = {now},
        expires_ms = NULL, outcome = NULL, outcome_is_err = 0, outcome_version = 0,
        steps = IF(steps = 0, 0, 3)
    WHERE scope = :scope AND name = :name AND `key` = :key AND state = 1
      AND expires_ms <= {now};
SELECT epoch FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = LAST_INSERT_ID()
