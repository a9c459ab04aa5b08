-- KEYS[1] the tenant's set of reporting processes (srv)
-- ARGV[1] now ('' = server TIME)  ARGV[2] the reporting process's id  ARGV[3] seconds a
-- report stays
-- returns the number of processes whose report stands, this one's included
-- One member a process, scored by the time of its report: which replicas and workers
-- apply their settings to the tenant where it stored none. What they apply is not here:
-- it is the same for every tenant a process serves, so it lives once a process
-- (report_process.lua, zerda_cache/storage/reports.py). Members older than ARGV[3] are
-- dropped here, and the set expires ARGV[3] after its last report, so a process that
-- stopped leaves no trace. Every call is a pcall: a report never fails the lookup or the
-- worker pass that carries it.
local now = ARGV[1]
if now == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(now)
end
local keep = tonumber(ARGV[3])
redis.pcall('ZADD', KEYS[1], string.format('%.3f', now), ARGV[2])
redis.pcall('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.3f', now - keep))
redis.pcall('PEXPIRE', KEYS[1], math.ceil(keep * 1000))
local standing = redis.pcall('ZCARD', KEYS[1])
if type(standing) ~= 'number' then
  return 0
end
return standing
