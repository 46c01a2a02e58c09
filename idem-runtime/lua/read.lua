-- No ARGV. The record's fields and the server's time, without writing:
-- {now, s, e, lu, ca, xa, o} ('' for a missing field), or {now} when there is no
-- record.
local now = now_ms()
local r = redis.call('HMGET', REC, 's', 'e', 'lu', 'ca', 'xa', 'o')
if not r[1] then
  return {now}
end
local out = {now}
for i = 1, 6 do
  out[i + 1] = r[i] or ''
end
return out
