-- Group commit: the record of record.sql for every element of a JSON array of [scope,
-- name, key, epoch, outcome in hex, is_err, version, retain_ms], in one statement. Keys
-- are distinct within a batch; a returned row is a record whose fence held. The unary
-- `+` keeps the indexes on `state` out of the plan, which would otherwise scan every
-- record in a state for each element instead of finding each by its key.
UPDATE {table} AS t
    SET state = 1, outcome = unhex(j.value ->> 4), outcome_is_err = j.value ->> 5,
        outcome_version = j.value ->> 6,
        expires_ms = CASE WHEN t.state = 0 THEN {now} + (j.value ->> 7) ELSE t.expires_ms END
    FROM json_each(:batch) AS j
    WHERE t.scope = j.value ->> 0 AND t.name = j.value ->> 1 AND t.key = j.value ->> 2
      AND t.epoch = j.value ->> 3
      AND ((+t.state = 0 AND t.steps <> 2)
           OR (+t.state = 1 AND t.outcome = unhex(j.value ->> 4)
               AND t.outcome_is_err = j.value ->> 5 AND t.outcome_version = j.value ->> 6))
    RETURNING scope, name, key, 1 AS held
