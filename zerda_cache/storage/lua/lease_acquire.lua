-- KEYS[1] the lease key.  ARGV[1] this holder's token  ARGV[2] time to live (ms)
-- returns the lease's fencing token (the server's TIME in microseconds, as a string) if
-- this holder took the lease; 0 when another holds it.
-- SET NX PX and the token in one step, runnable on a full server (allow-oom): a standby
-- must be able to take over and free memory. The token grows with every lease taken
-- (a new leader takes it after the old lease lapsed, at a later server time), so the
-- decay and evict scripts can refuse the writes of an older leader.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end
return 0
