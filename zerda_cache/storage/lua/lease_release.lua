-- KEYS[1] the lease key.  ARGV[1] this holder's token
-- returns 1 released; 0 not ours (lapsed, or another replica holds it: left alone).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
