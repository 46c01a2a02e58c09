-- ARGV: epoch. An operator's delete of the record held at epoch, with its steps:
-- COMPLETED or UNKNOWN, released, or IN_PROGRESS once its lease has lapsed (a live
-- claim is never dropped).
local state, r = held_state(ARGV[1])
local function lapsed()
  local f = redis.call('HMGET', REC, 'lu', 'e', 'll')
  return lease_end(f[1], f[2], f[3]) <= now_ms()
end
if state == '1' or state == '2' or state == 'released' or (state == '0' and lapsed()) then
  remove(r)
  return 1
end
return 0
