-- The floor for a fresh call in the caller's transaction: the claim, the business write
-- and the record commit together.
-- benches/pg.rs replaces {table} and {orders}.
\set k random(1, 1000000000)
BEGIN;
INSERT INTO {table} (scope, name, key) VALUES ('', 'bench', :k) ON CONFLICT DO NOTHING;
INSERT INTO {orders} (id, qty) VALUES (:k, 1) ON CONFLICT DO NOTHING;
UPDATE {table} SET outcome = '\x31' WHERE scope = '' AND name = 'bench' AND key = :k;
COMMIT;
