-- No ARGV. Flags the record as waited on, so finishing it publishes a wake-up.
if redis.call('EXISTS', REC) == 1 then
  redis.call('HSET', REC, 'w', '1')
end
return 0
