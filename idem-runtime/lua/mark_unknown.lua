-- ARGV: epoch. Moves an IN_PROGRESS record held at epoch to UNKNOWN.
local state, r = held_state(ARGV[1])
if state == '0' then
  wake(r[4])
  redis.call('HSET', REC, 's', '2')
  return 1
end
return 0
