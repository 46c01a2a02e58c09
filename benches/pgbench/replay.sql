-- The floor for a replay: one read of a recorded outcome by primary key.
-- benches/pg.rs replaces {table} and {rows} (the pre-populated keys 1..=rows).
\set k random(1, {rows})
SELECT outcome FROM {table} WHERE scope = '' AND name = 'bench' AND key = :k;
