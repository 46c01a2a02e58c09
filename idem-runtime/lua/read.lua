-- No ARGV. The record's fields and the server's time, without writing:
-- {now, s, e, fp, lu, ca, xa, err, v, body, sc, nm, k} (false for a missing field),
-- or {now} when there is no record.
local now = now_ms()
local r = redis.call('HMGET', REC, 's', 'e', 'fp', 'lu', 'ca', 'xa', 'err', 'v', 'body', 'sc', 'nm', 'k')
if not r[1] then
  return {now}
end
local out = {now}
for i = 1, 12 do
  out[i + 1] = r[i] or ''
end
return out
