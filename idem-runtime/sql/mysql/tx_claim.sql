INSERT INTO {epoch_seq} (id) VALUES (NULL);
DELETE FROM {epoch_seq} WHERE id = LAST_INSERT_ID();
INSERT INTO {table} (scope, name, `key`, state, epoch, fingerprint, token, taken_over,
        lease_until_ms, created_ms, claimed_ms)
    VALUES (:scope, :name, :key, 0, {next_epoch}, :fp, 0, 0, {now} + :lease_ms, {now}, {now})
    ON DUPLICATE KEY UPDATE epoch = epoch;
SELECT epoch FROM {table}
    WHERE scope = :scope AND name = :name AND `key` = :key AND epoch = LAST_INSERT_ID()
