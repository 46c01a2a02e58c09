-- One step, fenced by the record: the update takes the record's lock and says the
-- record holds steps; the first step of a life deletes an earlier life's (but one of its
-- own label, which the insert replaces: a statement changes a row once).
WITH op AS (
    UPDATE {table} SET steps = 1
    WHERE scope = :scope AND name = :name AND key = :key AND epoch = :epoch AND state = 0
      AND steps <> 2
    RETURNING scope, name, key
), earlier AS (
    DELETE FROM {steps} AS s
    USING {table} AS t
    WHERE t.scope = :scope AND t.name = :name AND t.key = :key AND t.epoch = :epoch
      AND t.state = 0 AND t.steps = 3
      AND s.scope = t.scope AND s.name = t.name AND s.key = t.key AND s.label <> :label
), ins AS (
    INSERT INTO {steps} (scope, name, key, label, epoch, recorded_at, outcome,
        outcome_is_err, outcome_version)
    SELECT scope, name, key, :label, :epoch, clock_timestamp(), :outcome, :is_err, :version
    FROM op
    ON CONFLICT (scope, name, key, label) DO UPDATE SET
        epoch = EXCLUDED.epoch, recorded_at = EXCLUDED.recorded_at, outcome = EXCLUDED.outcome,
        outcome_is_err = EXCLUDED.outcome_is_err, outcome_version = EXCLUDED.outcome_version
    RETURNING 1
)
SELECT count(*) AS held FROM ins
