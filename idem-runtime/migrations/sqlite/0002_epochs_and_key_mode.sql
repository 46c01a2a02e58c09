-- idem: epochs that never repeat, and the key mode the table was created with (SQLite).
-- One row holds the highest epoch ever issued for this table; every claim takes the next
-- one, so a fence (the epoch) identifies one claim for all time, even after its record
-- was released, resolved or purged. Triggers keep the row current inside the claim's own
-- statement (SQLite has one writer, so nothing can slip between).
CREATE TABLE IF NOT EXISTS idem_operations_meta (
    id         INTEGER PRIMARY KEY CHECK (id = 0),
    last_epoch INTEGER NOT NULL,
    -- how keys and scopes are stored: 'plain' or 'hmac-sha256:<check>'; NULL until the
    -- first open records it
    key_mode   TEXT
);

INSERT OR IGNORE INTO idem_operations_meta (id, last_epoch, key_mode)
    SELECT 0, COALESCE(MAX(epoch), 0), NULL FROM idem_operations;

CREATE TRIGGER IF NOT EXISTS idem_operations_epoch_ins AFTER INSERT ON idem_operations
    WHEN NEW.epoch > (SELECT last_epoch FROM idem_operations_meta WHERE id = 0)
BEGIN
    UPDATE idem_operations_meta SET last_epoch = NEW.epoch WHERE id = 0;
END;

CREATE TRIGGER IF NOT EXISTS idem_operations_epoch_upd AFTER UPDATE OF epoch ON idem_operations
    WHEN NEW.epoch > (SELECT last_epoch FROM idem_operations_meta WHERE id = 0)
BEGIN
    UPDATE idem_operations_meta SET last_epoch = NEW.epoch WHERE id = 0;
END;
