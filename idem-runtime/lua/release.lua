-- ARGV: epoch. Removes an IN_PROGRESS record held at epoch.
local state, r = held_state(ARGV[1])
if state == '0' then
  remove(r)
  return 1
end
return 0
