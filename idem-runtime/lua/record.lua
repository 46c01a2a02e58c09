-- ARGV: epoch, is_err (0/1), version, body, retain ms. Fenced on an IN_PROGRESS
-- record at epoch; the same record retried after a lost reply holds.
local state, r = held_state(ARGV[1])
if state == '0' then
  complete(r, now_ms(), ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]))
  return 1
end
if state == '1' then
  local o = redis.call('HMGET', REC, 'err', 'v', 'body')
  if o[1] == ARGV[2] and o[2] == ARGV[3] and o[3] == ARGV[4] then
    return 1
  end
end
return 0
