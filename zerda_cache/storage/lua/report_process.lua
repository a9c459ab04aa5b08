-- KEYS[1] the reporting process's key (p:proc:<process>)
-- ARGV[1] its report (JSON: role and settings)  ARGV[2] milliseconds it stays
-- returns 1 when written, 0 when not
-- What one replica or worker applies where a tenant stored none: the same for every
-- tenant it serves, so written once a process, at most every 15 s, and read beside the
-- tenant's set of reporting processes (report.lua, zerda_cache/storage/reports.py). A
-- pcall: a report never fails the lookup or the worker pass that carries it.
local ok = redis.pcall('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
if type(ok) == 'table' and ok.err then
  return 0
end
return 1
