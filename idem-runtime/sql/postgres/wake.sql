-- Wakes the callers that announced a wait on an operation the record just completed.
SELECT pg_notify('idem_wake', :payload) AS woke
