-- ARGV: epoch, label, outcome (`is_err:version:body`, packed by the client). Records
-- step `label` under an IN_PROGRESS claim held at epoch (not released), replacing the
-- label's earlier value in place. A step is packed as `seq:epoch:at:` and its outcome;
-- `seq` orders the steps, oldest first, and a label recorded again keeps its own.
local state, r = held_state(ARGV[1])
if state ~= '0' then
  return 0
end
if r[3] ~= '1' then
  -- The first step of this life: whatever the key holds is an earlier life's.
  redis.call('DEL', STEPS)
  redis.call('HSET', REC, 'st', '1')
end
local label = ARGV[2]
local old = redis.call('HGET', STEPS, label)
local seq
if old then
  seq = string.match(old, '^(%d+):')
else
  -- Labels are never removed within a life, so the count numbers them in order.
  seq = redis.call('HLEN', STEPS) + 1
end
local packed = seq .. ':' .. ARGV[1] .. ':' .. dec(now_ms()) .. ':' .. ARGV[3]
redis.call('HSET', STEPS, label, packed)
return 1
