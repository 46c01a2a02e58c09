-- No ARGV. The record's fields and the server's time, without writing:
-- {now, s, e, lu, ca, xa, o} ('' for a missing field; `lu` as `lease_end` gives it, and
-- `ca` from the epoch where a fresh claim wrote none), or {now} when there is no record.
local now = now_ms()
local r = redis.call('HMGET', REC, 's', 'e', 'lu', 'ca', 'xa', 'o', 'll')
if not r[1] then
  return {now}
end
r[3] = dec(lease_end(r[3], r[2], r[7]))
r[4] = r[4] or dec(math.floor(tonumber(r[2]) / 1000))
local out = {now}
for i = 1, 6 do
  out[i + 1] = r[i] or ''
end
return out
