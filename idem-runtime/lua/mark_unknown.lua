-- ARGV: epoch. Moves an IN_PROGRESS record held at epoch to UNKNOWN.
if held_state(ARGV[1]) == '0' then
  wake()
  redis.call('HSET', REC, 's', 2)
  return 1
end
return 0
