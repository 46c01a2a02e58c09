CREATE TABLE IF NOT EXISTS {bookkeeping} (
    table_name VARCHAR(64) NOT NULL,
    version    INT         NOT NULL,
    applied_ms BIGINT      NOT NULL,
    PRIMARY KEY (table_name, version)
) ENGINE = InnoDB
