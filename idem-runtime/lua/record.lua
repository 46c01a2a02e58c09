-- ARGV: epoch, outcome (`<is_err>:<version>:<body>`), retain ms; and from a client
-- that bounds this server's clock from below, the retention deadline (ms) and the
-- record's TTL (ms), in decimal. Fenced on an IN_PROGRESS record at epoch; the same
-- record retried after a lost reply holds.
local r = redis.call('HMGET', REC, 's', 'e', 'st', 'w')
if r[1] == '0' and r[2] == ARGV[1] and not r[3] and not r[4] then
  -- The common case, before the helpers are made: held, no steps, no waiter. Given
  -- the deadline, it reads no `TIME` and formats no number: a third of its work.
  finish(ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5])
  return 1
end
--[[lifecycle]]
local state = held_state(ARGV[1], r)
if state == '0' then
  complete(r, ARGV[2], tonumber(ARGV[3]))
  return 1
end
if state == '1' and redis.call('HGET', REC, 'o') == ARGV[2] then
  return 1
end
return 0
