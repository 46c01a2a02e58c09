-- ARGV: fingerprint, lease ms, on_takeover ('rerun' | 'unknown'), scope, name, key.
-- One decision: fresh, replay, in flight, mismatch, takeover or unknown.
local fp, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = now_ms()

-- `replace`: an expired record is there to be replaced.
local function acquire(takeover, replace)
  -- The counter outlives the record, so this epoch is above every earlier one. A
  -- counter INCR just made has no expiry to remove.
  local epoch = redis.call('INCR', CTR)
  if epoch > 1 then
    redis.call('PERSIST', CTR)
  end
  if replace then
    redis.call('DEL', REC)
  end
  if takeover == 0 then
    redis.call('HSET', REC, 's', 0, 'e', epoch, 'fp', fp, 'lu', now + lease, 'ca', now,
      'sc', ARGV[4], 'nm', ARGV[5], 'k', ARGV[6])
  else
    redis.call('HSET', REC, 'e', epoch, 'lu', now + lease, 'ca', now)
  end
  return {'acquired', epoch, takeover}
end

-- One read serves every answer, the replay's outcome included.
local r = redis.call('HMGET', REC, 's', 'e', 'fp', 'lu', 'xa', 'err', 'v', 'body')
if not r[1] then
  return acquire(0, false)
end
local state, epoch = r[1], tonumber(r[2])
if state == '1' and tonumber(r[5]) <= now then
  -- Past retention: absent, whatever fingerprint it had.
  return acquire(0, true)
end
if r[3] ~= fp then
  return {'mismatch'}
end
if state == '1' then
  return {'completed', tonumber(r[6]), tonumber(r[7]), r[8]}
end
if state == '2' then
  return {'unknown', epoch, 0}
end
local lease_until = tonumber(r[4])
if lease_until > now then
  return {'inflight', lease_until - now}
end
if mode == 'unknown' then
  wake(redis.call('HMGET', REC, 's', 'e', 'w', 'sc', 'nm', 'k'))
  redis.call('HSET', REC, 's', 2)
  return {'unknown', epoch, 1}
end
return acquire(1, false)
