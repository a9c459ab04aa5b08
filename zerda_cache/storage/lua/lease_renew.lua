-- KEYS[1] the lease key.  ARGV[1] this holder's token  ARGV[2] new time to live (ms)
-- returns 1 renewed; 0 the lease is not (or no longer) ours: it lapsed or another holds it.
-- A stalled replica can never extend a lease another replica took over.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
