-- idem: the claim as a stored procedure, second version (MySQL 8.0.29 and later, MariaDB
-- 10.1.3 and later): `idem_operations_claim_v2`, as 0003_claim_procedure.sql's
-- `idem_operations_claim` (which stays, for processes of the earlier version), and
-- besides it a record released with its steps (`steps = 2`) past its expiry is treated
-- as absent, as an expired COMPLETED record is: claimed afresh by any fingerprint,
-- without its steps. Idempotent: safe to run again. Needs the `CREATE ROUTINE`
-- privilege; `SQL SECURITY INVOKER`. The body holds statements ending in `;` (see
-- 0003_claim_procedure.sql for running it by hand).
--
-- In one transaction, rolled back whole on any error, which is then raised again as it
-- was:
-- 1. The upsert decides. It inserts a fresh claim, or takes an existing row over when
--    it is expired (a COMPLETED record past its retention, or one released with steps
--    past its expiry), a lapsed lease of the same fingerprint or a record released with
--    steps of the same fingerprint, or leaves it alone; `p_token`, random per attempt,
--    written into the row says whether this claim wrote it. Its assignments rely on
--    left-to-right evaluation: the decision (`token`) first, then `expires_ms`, which
--    a claim it made sets to 0 where the row was expired (a new life) and to NULL
--    otherwise, so every assignment after judges "a new life" by `expires_ms = 0`; the
--    state last. A claim it made carries epoch 0 and, for a new life, `expires_ms` 0.
-- 2. Only then is an epoch drawn (a replay or an in-flight answer draws none): a row
--    inserted into the counter table, its `AUTO_INCREMENT` value taken as the epoch,
--    the row deleted, and `expires_ms` cleared. Epochs therefore never repeat.
-- 3. The upsert holds the row's exclusive lock until commit, so the read reports
--    exactly the row it decided. The read only reports: never a read followed by a
--    write.
CREATE PROCEDURE IF NOT EXISTS idem_operations_claim_v2(
    IN p_scope VARBINARY(255), IN p_name VARBINARY(255), IN p_key VARBINARY(255),
    IN p_fp BINARY(32), IN p_token BIGINT, IN p_lease_ms BIGINT, IN p_to_unknown BOOLEAN)
    MODIFIES SQL DATA
    SQL SECURITY INVOKER
BEGIN
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        RESIGNAL;
    END;
    START TRANSACTION;
    INSERT INTO idem_operations (scope, name, `key`, state, epoch, fingerprint, token,
            taken_over, lease_until_ms, created_ms, claimed_ms, expires_ms, outcome,
            outcome_is_err, outcome_version)
        VALUES (p_scope, p_name, p_key, 0, 0, p_fp, p_token, 0,
            (TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(3)) DIV 1000) + p_lease_ms,
            (TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(3)) DIV 1000),
            (TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(3)) DIV 1000),
            NULL, NULL, 0, 0)
        ON DUPLICATE KEY UPDATE
            -- expired: a COMPLETED record past its retention, or one released with its
            -- steps past its expiry; lapsed: a lease that ran out, of the same
            -- fingerprint; released: a record kept for its steps, of the same
            -- fingerprint (no lease: it resumes at once).
            token = IF(((state = 1 OR (state = 0 AND steps = 2))
                        AND expires_ms <= VALUES(claimed_ms))
                       OR (state = 0 AND lease_until_ms <= VALUES(claimed_ms)
                           AND fingerprint = VALUES(fingerprint))
                       OR (state = 0 AND steps = 2 AND fingerprint = VALUES(fingerprint)),
                       VALUES(token), token),
            expires_ms = IF(token = VALUES(token),
                            IF((state = 1 OR (state = 0 AND steps = 2))
                               AND expires_ms <= VALUES(claimed_ms), 0, NULL),
                            expires_ms),
            epoch = IF(token = VALUES(token)
                       AND (expires_ms = 0 OR steps = 2 OR NOT p_to_unknown),
                       VALUES(epoch), epoch),
            fingerprint = IF(token = VALUES(token) AND expires_ms = 0, VALUES(fingerprint),
                             fingerprint),
            taken_over = IF(token = VALUES(token),
                            IF(expires_ms = 0 OR steps = 2, 0, IF(p_to_unknown, taken_over, 1)),
                            taken_over),
            lease_until_ms = IF(token = VALUES(token)
                                AND (expires_ms = 0 OR steps = 2 OR NOT p_to_unknown),
                                VALUES(lease_until_ms), lease_until_ms),
            created_ms = IF(token = VALUES(token) AND expires_ms = 0, VALUES(created_ms),
                            created_ms),
            claimed_ms = IF(token = VALUES(token)
                            AND (expires_ms = 0 OR steps = 2 OR NOT p_to_unknown),
                            VALUES(claimed_ms), claimed_ms),
            outcome = IF(token = VALUES(token) AND expires_ms = 0, NULL, outcome),
            outcome_is_err = IF(token = VALUES(token) AND expires_ms = 0, 0, outcome_is_err),
            outcome_version = IF(token = VALUES(token) AND expires_ms = 0, 0, outcome_version),
            state = IF(token = VALUES(token),
                       IF(expires_ms = 0 OR steps = 2 OR NOT p_to_unknown, 0, 2), state),
            steps = IF(token = VALUES(token) AND expires_ms = 0, IF(steps = 0, 0, 3), steps);
    INSERT INTO idem_operations_epoch_seq (id)
        SELECT NULL FROM idem_operations
        WHERE scope = p_scope AND name = p_name AND `key` = p_key AND token = p_token
          AND epoch = 0;
    IF ROW_COUNT() > 0 THEN
        UPDATE idem_operations
            SET epoch = LAST_INSERT_ID(), steps = IF(steps = 2, 1, steps), expires_ms = NULL
            WHERE scope = p_scope AND name = p_name AND `key` = p_key AND token = p_token
              AND epoch = 0;
        DELETE FROM idem_operations_epoch_seq WHERE id = LAST_INSERT_ID();
    END IF;
    SELECT token = p_token AS mine, state, epoch, fingerprint = p_fp AS same_fingerprint,
            taken_over, steps = 1 AS resume,
            GREATEST(0, lease_until_ms
                - (TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(3)) DIV 1000))
                AS retry_after_ms,
            IF(fingerprint = p_fp, outcome, NULL) AS outcome, outcome_is_err, outcome_version
        FROM idem_operations
        WHERE scope = p_scope AND name = p_name AND `key` = p_key FOR UPDATE;
    COMMIT;
END;
