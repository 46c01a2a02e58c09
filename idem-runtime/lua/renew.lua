-- ARGV: epoch, lease ms. Extends the lease of an IN_PROGRESS record held at epoch.
if held_state(ARGV[1]) == '0' then
  redis.call('HSET', REC, 'lu', dec(now_ms() + tonumber(ARGV[2])))
  return 1
end
return 0
