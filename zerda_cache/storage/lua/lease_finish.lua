-- KEYS[1] the lease key.  ARGV[1] this holder's token  ARGV[2] the marker to leave
-- ARGV[3] how long the marker stays (ms)
-- returns 1 finished; 0 not ours (lapsed, or another holds it: left alone).
-- A coalesced upstream call's end (service/coordination.py): the lease becomes a short
-- marker of how it ended, which the waiters read, instead of vanishing.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
