-- A shared claim limit (`ClaimLimit::shared`): one new claim from a key's allowance.
-- Standalone (no prelude). KEYS[1] the count; ARGV[1] the interval between claims and
-- ARGV[2] the window (burst × interval), both in µs.
--
-- GCRA: the key holds the theoretical arrival time (µs, the server's clock). A claim is
-- allowed when the time it would push that to is within the window from now; the key
-- expires when the allowance is whole again, which is what a missing key means.
-- Returns 0 when allowed, else the µs until a claim would be.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local every, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then
  tat = now
end
local nxt = tat + every
if nxt - now > window then
  return string.format('%.0f', nxt - window - now)
end
redis.call('SET', KEYS[1], string.format('%.0f', nxt), 'PX',
  string.format('%.0f', math.ceil((nxt - now) / 1000)))
return 0
