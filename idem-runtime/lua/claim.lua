-- ARGV: fingerprint, lease ms, on_takeover ('rerun' | 'unknown'), the operation's `sn`
-- and key (the record's fields). One decision: fresh, replay, in flight, mismatch,
-- takeover, resume or unknown. Acquired: the epoch alone (in decimal) for a fresh
-- claim, else {'acquired', epoch, takeover (0/1), resume (0/1)}.
local t = redis.call('TIME')
-- The server's clock in microseconds, in decimal: a new record's epoch, and the least
-- epoch a claim takes, so epochs follow the clock across the record's lives.
local clock = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]

-- A new record, a new life without steps: its claim time and lease deadline follow
-- from `e` and `ll` (see prelude.lua).
local function create()
  redis.call('HSET', REC, 's', '0', 'e', clock, 'fp', ARGV[1], 'll', ARGV[2],
    'sn', ARGV[4], 'k', ARGV[5])
  return clock
end

-- No record: the common case, told by `EXISTS`, which costs the server a fifth of an
-- `HMGET` of eight fields turned into a Lua table.
if redis.call('EXISTS', REC) == 0 then
  return create()
end
-- One read serves every other answer, the replay's outcome included.
local r = redis.call('HMGET', REC, 's', 'e', 'fp', 'lu', 'xa', 'o', 'st', 'll')
if not r[1] then
  return create()
end
--[[lifecycle]]
local fp, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- The record (at epoch `held`) claimed again: a lapsed claim taken over (`takeover` 1)
-- or a released one resumed; `resume` 1 when it has steps, which are then live again.
local function reclaim(held, takeover, resume)
  local epoch = math.max(held + 1, tonumber(clock))
  if resume == 1 then
    redis.call('HSET', REC, 'e', dec(epoch), 'lu', dec(now + lease), 'ca', dec(now),
      'st', '1')
  else
    redis.call('HSET', REC, 'e', dec(epoch), 'lu', dec(now + lease), 'ca', dec(now))
  end
  return {'acquired', epoch, takeover, resume}
end

local state, epoch = r[1], tonumber(r[2])
if (state == '1' or (state == '0' and r[7] == '2')) and r[5] and tonumber(r[5]) <= now then
  -- Past retention (a completed record, or one released with its steps): absent,
  -- whatever fingerprint it had; with the hash go its steps flag and its steps.
  redis.call('DEL', REC)
  if r[7] then
    redis.call('DEL', STEPS)
  end
  return create()
end
if r[3] ~= fp then
  return {'mismatch'}
end
if state == '1' then
  return {'completed', r[6]}
end
if state == '2' then
  return {'unknown', epoch, 0}
end
if r[7] == '2' then
  -- Released with its steps: its last attempt ended knowing what it had done, so it
  -- resumes at once, whatever `on_takeover` says; held again, it no longer expires.
  redis.call('HDEL', REC, 'xa')
  redis.call('PERSIST', REC)
  redis.call('PERSIST', STEPS)
  return reclaim(epoch, 0, 1)
end
local lease_until = lease_end(r[4], r[2], r[8])
if lease_until > now then
  return {'inflight', lease_until - now}
end
if mode == 'unknown' then
  wake(redis.call('HGET', REC, 'w'))
  redis.call('HSET', REC, 's', '2')
  return {'unknown', epoch, 1}
end
if r[7] == '1' then
  return reclaim(epoch, 1, 1)
end
return reclaim(epoch, 1, 0)
