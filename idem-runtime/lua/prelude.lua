-- Shared by every idem script; the store prepends it. KEYS[1] is the record (a hash),
-- KEYS[2] its steps (a hash: label -> packed step); both carry the same hash tag, so
-- one script touches one slot in Redis Cluster.
-- Times are the server's, in milliseconds.
--
-- The record's fields: `s` state ('0' in progress, '1' completed, '2' unknown), `e`
-- epoch, `fp` fingerprint, `lu` lease deadline, `ca` claim time, `sn` and `k` the
-- operation (`sn` is `<len>:<scope><len>:<name>`, `k` the key), `w` set once a waiter
-- announced itself, `st` the steps flag, and for a completed record `xa` its retention
-- deadline and `o` its outcome, `<is_err>:<version>:<body>`.
--
-- The field `st` says what the steps key holds for this life of the record: absent, no
-- steps (whatever is there is left from an earlier life); '1', steps; '2', steps, and
-- the claim was released for the next claim to resume. Only records with steps pay for
-- them: every other path reads the field and does nothing more.
--
-- A number handed to `redis.call` is formatted with `%.17g`, several times slower than
-- a string made with `dec`, so the scripts pass strings.
local REC, STEPS = KEYS[1], KEYS[2]
-- How long Redis keeps a completed record past its retention: claims treat it as
-- absent from the retention on, purge_expired deletes it early, Redis drops it here.
local GRACE_MS = 300000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- `n`, a whole number from 0 below 2^53, in decimal. `%d` takes a C long, which some
-- platforms keep to 32 bits, so it formats the number in two parts.
local function dec(n)
  if n < 1000000 then
    return string.format('%d', n)
  end
  return string.format('%d%06d', math.floor(n / 1000000), n % 1000000)
end

-- The record's state ('0' in progress, '1' completed, '2' unknown, 'released' for a
-- claim released with its steps, which its epoch no longer holds) if it exists and is
-- at `epoch` (compared as the decimal string), else nil; and the fields a write needs
-- next: {s, e, st, w}, so a write reads the record once.
local function held_state(epoch)
  local r = redis.call('HMGET', REC, 's', 'e', 'st', 'w')
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
  redis.call('HSET', REC, 's', '1', 'o', outcome, 'xa', dec(now_ms() + retain))
  redis.call('PEXPIRE', REC, dec(retain + GRACE_MS))
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
-- with the same fingerprint to resume at once.
local function give_up(r)
  if r[3] then
    wake(r[4])
    redis.call('HSET', REC, 's', '0', 'st', '2', 'lu', dec(now_ms()))
  else
    remove(r)
  end
end
