-- ARGV: epoch. Gives up an IN_PROGRESS claim held at epoch: the record goes, or stays
-- released if it has steps.
local state, r = held_state(ARGV[1])
if state == '0' then
  give_up(r)
  return 1
end
return 0
