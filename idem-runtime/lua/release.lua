-- ARGV: epoch, retain ms. Gives up an IN_PROGRESS claim held at epoch: the record goes,
-- or stays released for retain ms if it has steps.
local state, r = held_state(ARGV[1])
if state == '0' then
  give_up(r, tonumber(ARGV[2]))
  return 1
end
return 0
