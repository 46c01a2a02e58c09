-- Group commit: the insert claim.sql makes for a key with no record, for every element
-- of a JSON array of [scope, name, key, fingerprint in hex, lease_ms], in one statement.
-- A key that exists inserts nothing and returns no row: claim.sql decides it. Keys are
-- distinct within a batch. The epochs are the next ones up, one an element, whether the
-- epoch subquery is read once or again for each row; a row not inserted leaves a gap.
-- The token of an inserted row is random: it is compared only with a later claim's own.
INSERT INTO {table} (scope, name, key, state, epoch, fingerprint, token, taken_over,
        lease_until_ms, created_ms, claimed_ms, expires_ms, outcome, outcome_is_err,
        outcome_version)
    SELECT j.value ->> 0, j.value ->> 1, j.value ->> 2, 0,
        (SELECT last_epoch FROM {meta} WHERE id = 0) + 1 + j.key, unhex(j.value ->> 3),
        random(), 0, {now} + (j.value ->> 4), {now}, {now}, NULL, NULL, 0, 0
    FROM json_each(:batch) AS j
    -- SQLite needs a WHERE here to parse the upsert after a SELECT.
    WHERE true
    ON CONFLICT (scope, name, key) DO NOTHING
    RETURNING scope, name, key, 1 AS mine, state, epoch, 1 AS same_fingerprint, taken_over,
        steps = 1 AS resume, lease_until_ms - {now} AS retry_after_ms, outcome,
        outcome_is_err, outcome_version
