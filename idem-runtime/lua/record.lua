-- ARGV: epoch, outcome (`<is_err>:<version>:<body>`), retain ms. Fenced on an
-- IN_PROGRESS record at epoch; the same record retried after a lost reply holds.
local state, r = held_state(ARGV[1])
if state == '0' then
  complete(r, ARGV[2], tonumber(ARGV[3]))
  return 1
end
if state == '1' and redis.call('HGET', REC, 'o') == ARGV[2] then
  return 1
end
return 0
