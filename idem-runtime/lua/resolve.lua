-- ARGV: epoch, 'retry' | 'complete', outcome (`<is_err>:<version>:<body>`, empty for a
-- retry), retain ms. Settles an UNKNOWN or IN_PROGRESS record held at epoch, a released
-- one included (an operator may settle what its last attempt gave up); a retry gives it
-- up as a release does, kept for retain ms.
local state, r = held_state(ARGV[1])
if state ~= '0' and state ~= '2' and state ~= 'released' then
  return 0
end
if ARGV[2] == 'retry' then
  give_up(r, tonumber(ARGV[4]))
else
  complete(r, ARGV[3], tonumber(ARGV[4]))
end
return 1
