-- ARGV: epoch. An operator's delete of the record held at epoch, with its steps:
-- COMPLETED or UNKNOWN, released, or IN_PROGRESS once its lease has lapsed (a live
-- claim is never dropped).
local state, r = held_state(ARGV[1])
if state == '1' or state == '2' or state == 'released'
  or (state == '0' and tonumber(redis.call('HGET', REC, 'lu')) <= now_ms()) then
  remove(r)
  return 1
end
return 0
