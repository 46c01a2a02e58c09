INSERT INTO {epoch_seq} (id) VALUES (NULL);
DELETE FROM {epoch_seq} WHERE id = LAST_INSERT_ID();
UPDATE {table}
    SET epoch = {next_epoch}, token = 0, taken_over = 1, lease_until_ms = {now} + :lease_ms,
        claimed_ms = {now}, steps = IF(steps = 2, 1, steps)
    WHERE scope = :scope AND name = :name AND `key` = :key AND state = 0
      AND lease_until_ms <= {now} AND fingerprint = :fp;
SELECT epoch FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = LAST_INSERT_ID()
