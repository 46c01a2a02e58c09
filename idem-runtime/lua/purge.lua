-- KEYS: the record and its steps. No ARGV. Deletes the record if it is past its
-- retention: COMPLETED, or released with its steps (those go too); 1 if it did.
local r = redis.call('HMGET', REC, 's', 'xa', 'st')
if (r[1] == '1' or (r[1] == '0' and r[3] == '2')) and r[2] and tonumber(r[2]) <= now_ms() then
  redis.call('DEL', REC)
  if r[3] then
    redis.call('DEL', STEPS)
  end
  return 1
end
return 0
