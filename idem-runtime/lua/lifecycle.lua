-- The helpers of a record's life, for the scripts that change it (see prelude.lua).

-- The lease deadline (ms) of a record with fields `lu`, `e` and `ll` as read: `lu` once
-- a renewal or a later claim wrote it, else the claim time its epoch gives plus `ll`.
local function lease_end(lu, e, ll)
  if lu then
    return tonumber(lu)
  end
  return math.floor(tonumber(e) / 1000) + tonumber(ll)
end

-- The record's state ('0' in progress, '1' completed, '2' unknown, 'released' for a
-- claim released with its steps, which its epoch no longer holds) if it exists and is
-- at `epoch` (compared as the decimal string), else nil; and the fields a write needs
-- next: {s, e, st, w}, so a write reads the record once.
-- `r`: those fields if the script has read them already.
local function held_state(epoch, r)
  r = r or redis.call('HMGET', REC, 's', 'e', 'st', 'w')
  if r[1] and r[2] == epoch then
    if r[3] == '2' then
      return 'released', r
    end
    return r[1], r
  end
  return nil, r
end

-- Tells waiting processes that the operation moved on, if any announced a wait (`w`,
-- the record's field): on the channel `<prefix>:wake`, the operation as
-- `<len>:<scope><len>:<name><key>`.
local function wake(w)
  if w then
    local op = redis.call('HMGET', REC, 'sn', 'k')
    local channel = string.sub(REC, 1, #REC - 37) .. ':wake'
    redis.call('PUBLISH', channel, op[1] .. op[2])
  end
end

-- Completes the record with its outcome (`o`, packed) kept for `retain` ms; `r` is the
-- record as `held_state` read it. Its steps go: a completed operation replays its
-- outcome, and they must not outlive the record.
local function complete(r, outcome, retain)
  wake(r[4])
  if r[3] then
    redis.call('DEL', STEPS)
    redis.call('HDEL', REC, 'st')
  end
  finish(outcome, retain)
end

-- Removes the record and its steps.
local function remove(r)
  wake(r[4])
  redis.call('DEL', REC)
  if r[3] then
    redis.call('DEL', STEPS)
  end
end

-- Gives the claim up: a record without steps goes; one with steps stays IN_PROGRESS
-- with its fingerprint and steps, released with its lease lapsed, for the next claim
-- with the same fingerprint to resume at once, until it expires `retain` ms from now
-- (`xa`). Past that, claims treat it as absent and purge_expired deletes it; Redis
-- drops it and its steps by themselves a grace period later, as a completed record.
local function give_up(r, retain)
  if r[3] then
    wake(r[4])
    local now = now_ms()
    redis.call('HSET', REC, 's', '0', 'st', '2', 'lu', dec(now), 'xa', dec(now + retain))
    redis.call('PEXPIRE', REC, dec(retain + GRACE_MS))
    redis.call('PEXPIRE', STEPS, dec(retain + GRACE_MS))
  else
    remove(r)
  end
end
