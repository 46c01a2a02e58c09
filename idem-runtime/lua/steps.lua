-- No ARGV. The steps of the record's current life with the server's time, without
-- writing: {now, label, packed, label, packed, ...} (packed as record_step.lua writes
-- it, in no order), or {now} when the record is gone or has no steps in this life.
local now = now_ms()
local st = redis.call('HGET', REC, 'st')
if st ~= '1' and st ~= '2' then
  return {now}
end
local out = redis.call('HGETALL', STEPS)
table.insert(out, 1, now)
return out
