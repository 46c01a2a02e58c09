-- KEYS: the record alone. No ARGV. Deletes the record if it is COMPLETED past its
-- retention; 1 if it did.
local r = redis.call('HMGET', REC, 's', 'xa')
if r[1] == '1' and tonumber(r[2]) <= now_ms() then
  redis.call('DEL', REC)
  return 1
end
return 0
