-- KEYS[1] the tenant's calibration hash (cal)
-- ARGV[1] window: lookups kept at full weight
-- returns the tenant's lookup count after this (halved or not)
-- Replicas count their lookups in the cal hash with plain HINCRBYFLOATs (t:<bin> per
-- score bin of the best near candidate, t:x without one, tn in all; t<v>: under a
-- model of version v; see
-- zerda_cache/calibration.py). When a replica sees tn past the window it runs this: every
-- lookup count is halved, so the shares follow the recent traffic. The check is inside,
-- so two replicas that both saw the count past the window halve it once. The label
-- counts (r:, w:, n) are left alone.
local total = tonumber(redis.call('HGET', KEYS[1], 'tn') or '0') or 0
if total <= tonumber(ARGV[1]) then
  return tostring(total)
end
local all = redis.call('HGETALL', KEYS[1])
total = 0
for i = 1, #all, 2 do
  local name, value = all[i], tonumber(all[i + 1])
  if string.find(name, '^t%d*:') then
    if value == nil or value * 0.5 < 0.01 then
      redis.call('HDEL', KEYS[1], name)
    else
      redis.call('HSET', KEYS[1], name, string.format('%.17g', value * 0.5))
      total = total + value * 0.5
    end
  end
end
redis.call('HSET', KEYS[1], 'tn', string.format('%.17g', total))
return tostring(total)
