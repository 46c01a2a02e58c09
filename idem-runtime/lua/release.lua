-- ARGV: epoch. Removes an IN_PROGRESS record held at epoch.
if held_state(ARGV[1]) == '0' then
  remove()
  return 1
end
return 0
