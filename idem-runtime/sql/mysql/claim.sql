CALL {claim_procedure}(:scope, :name, :key, :fp, :token, :lease_ms, :to_unknown)
