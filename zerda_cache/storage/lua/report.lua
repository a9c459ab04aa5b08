-- KEYS[1] the tenant's report hash (rep)
-- ARGV[1] now ('' = server TIME)  ARGV[2] the reporting process's id  ARGV[3] its report
-- (JSON: role and settings)  ARGV[4] seconds a report stays
-- returns the number of processes whose report stands, this one's included
-- One field a process, "<time> <report>": the settings a replica or worker applies to
-- the tenant when it stored nothing (zerda_cache/storage/reports.py). Reports older than
-- ARGV[4] are dropped here, and the hash expires ARGV[4] after its last report, so a
-- process that stopped leaves no trace. Every call is a pcall: a report never fails the
-- lookup or the worker pass that carries it.
local now = ARGV[1]
if now == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(now)
end
local keep = tonumber(ARGV[4])
local fields = redis.pcall('HGETALL', KEYS[1])
if type(fields) ~= 'table' or fields.err then
  return 0
end
local stale, standing = {}, 1
for i = 1, #fields, 2 do
  if fields[i] ~= ARGV[2] then
    local at = tonumber(string.match(fields[i + 1], '^(%S+) '))
    if at == nil or now - at > keep then
      stale[#stale + 1] = fields[i]
    else
      standing = standing + 1
    end
  end
end
if #stale > 0 then
  redis.pcall('HDEL', KEYS[1], unpack(stale))
end
redis.pcall('HSET', KEYS[1], ARGV[2], string.format('%.3f', now) .. ' ' .. ARGV[3])
redis.pcall('PEXPIRE', KEYS[1], math.ceil(keep * 1000))
return standing
