-- Shared by every idem script; the store prepends it. KEYS[1] is the record (a hash),
-- KEYS[2] its steps (a hash: label -> packed step); both carry the same hash tag, so
-- one script touches one slot in Redis Cluster.
-- Times are the server's, in milliseconds.
--
-- The record's fields: `s` state ('0' in progress, '1' completed, '2' unknown), `e`
-- epoch, `fp` fingerprint, `ll` the claim's lease (ms), `lu` lease deadline and `ca`
-- claim time, `sn` and `k` the operation (`sn` is `<len>:<scope><len>:<name>`, `k` the
-- key), `w` set once a waiter announced itself, `st` the steps flag, and for a
-- completed record `xa` its retention deadline and `o` its outcome,
-- `<is_err>:<version>:<body>`.
--
-- A new record's epoch is the server's clock in µs when it was claimed, so its claim
-- time is `e` / 1000 and its lease deadline that plus `ll`: it is written without `ca`
-- and `lu`, and with no number converted or formatted. A renewal or a later claim of
-- the record writes both (`lease_end` in lifecycle.lua and read.lua read either).
--
-- The field `st` says what the steps key holds for this life of the record: absent, no
-- steps (whatever is there is left from an earlier life); '1', steps; '2', steps, and
-- the claim was released for the next claim to resume. Only records with steps pay for
-- them: every other path reads the field and does nothing more.
--
-- A number handed to `redis.call` is formatted with `%.17g`, several times slower than
-- a string made with `dec`, so the scripts pass strings.
--
-- Each function a script defines is made anew on every call (about 0.1 µs each), so
-- the prelude holds only what every script needs; the helpers of the record's life
-- are in lifecycle.lua, which a script takes after its common case (at the line
-- `--[[lifecycle]]`, or else at its top).
local REC, STEPS = KEYS[1], KEYS[2]
-- How long Redis keeps a completed record past its retention: claims treat it as
-- absent from the retention on, purge_expired deletes it early, Redis drops it here.
local GRACE_MS = 300000

-- The server's clock in milliseconds, and the `TIME` reply it was read from.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), t
end

-- `n`, a whole number from 0 below 2^53, in decimal. `%d` takes a C long, which some
-- platforms keep to 32 bits, so it formats the number in two parts below 2^31 each.
local function dec(n)
  if n < 1000000000 then
    return string.format('%d', n)
  end
  return string.format('%d%09d', math.floor(n / 1000000000), n % 1000000000)
end

-- Writes the record COMPLETED with its outcome (`o`, packed) kept for `retain` ms: until
-- `xa` with the TTL `ttl` (ms, in decimal) where the client gave them, else from the
-- server's clock.
local function finish(outcome, retain, xa, ttl)
  redis.call('HSET', REC, 's', '1', 'o', outcome, 'xa', xa or dec(now_ms() + retain))
  redis.call('PEXPIRE', REC, ttl or dec(retain + GRACE_MS))
end
