-- Group commit: the record of record.sql for every row of the arrays, in one statement
-- and one transaction. Keys are distinct within a batch; `ord` (1-based) says which
-- request a result row answers, `held` whether its fence held.
WITH input AS (
    SELECT * FROM unnest(:scopes::text[], :names::text[], :keys::text[], :epochs::bigint[],
        :outcomes::bytea[], :is_errs::bool[], :versions::bigint[], :retain_mss::bigint[],
        :payloads::text[])
        WITH ORDINALITY AS i(scope, name, key, epoch, outcome, is_err, version, retain_ms,
            payload, ord)
), upd AS (
    UPDATE {table} AS t
    SET state = 1, outcome = i.outcome, outcome_is_err = i.is_err, outcome_version = i.version,
        expires_at = CASE WHEN t.state = 0
                          THEN clock_timestamp() + i.retain_ms * interval '1 millisecond'
                          ELSE t.expires_at END
    FROM input AS i
    WHERE t.scope = i.scope AND t.name = i.name AND t.key = i.key AND t.epoch = i.epoch
      AND ((t.state = 0 AND t.steps <> 2)
           OR (t.state = 1 AND t.outcome = i.outcome AND t.outcome_is_err = i.is_err
               AND t.outcome_version = i.version))
    RETURNING i.ord, t.waiters, i.payload
), woke AS (
    SELECT pg_notify('idem_wake', payload) FROM upd WHERE waiters
)
SELECT i.ord, (SELECT count(*) FROM upd WHERE upd.ord = i.ord) AS held,
    (SELECT count(*) FROM woke) AS woke
FROM input AS i
