-- idem: epochs that never repeat, and the key mode the table was created with
-- (PostgreSQL). Every claim takes its epoch from one sequence, so a fence (the epoch)
-- identifies one claim for all time, even after its record was released, resolved or
-- purged. The sequence starts above every epoch already in the table.
CREATE SEQUENCE IF NOT EXISTS idem_operations_epoch_seq;

SELECT setval('idem_operations_epoch_seq',
    GREATEST((SELECT COALESCE(MAX(epoch), 0) FROM idem_operations),
             COALESCE(pg_sequence_last_value('idem_operations_epoch_seq'), 0)) + 1, false);

CREATE TABLE IF NOT EXISTS idem_operations_meta (
    id       SMALLINT PRIMARY KEY CHECK (id = 0),
    -- how keys and scopes are stored: 'plain' or 'hmac-sha256:<check>'; NULL until the
    -- first open records it
    key_mode TEXT
);

INSERT INTO idem_operations_meta (id, key_mode) VALUES (0, NULL) ON CONFLICT (id) DO NOTHING;
