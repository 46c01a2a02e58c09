-- The floor for a fresh call: claim the key if absent, then record the outcome, each
-- statement its own autocommit transaction, as idem's claim and record are.
-- benches/pg.rs replaces {table} before handing the script to pgbench.
\set k random(1, 1000000000)
INSERT INTO {table} (scope, name, key) VALUES ('', 'bench', :k) ON CONFLICT DO NOTHING;
UPDATE {table} SET outcome = '\x31' WHERE scope = '' AND name = 'bench' AND key = :k;
