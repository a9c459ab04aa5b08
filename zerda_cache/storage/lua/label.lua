-- KEYS[1] the tenant's calibration hash (cal)
-- ARGV[1] similarity bin (0-based)  ARGV[2] 1 = the cached answer was right, 0 = wrong
-- ARGV[3] window: when the label count passes it, every count is halved
-- returns the tenant's label count after this one (halving included)
-- Counts one labelled outcome of a near match (zerda_cache/calibration.py). Halving keeps
-- the last ~window labels' weight, so the serving threshold follows a drift; counts
-- under 0.01 after halving are dropped. Only the label counts (r:, w:) are halved here:
-- the lookup counts (t:, tn) have their own window (traffic.lua).
local field = (ARGV[2] == '1' and 'r:' or 'w:') .. ARGV[1]
redis.call('HINCRBYFLOAT', KEYS[1], field, 1)
local total = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 'n', 1))
if total > tonumber(ARGV[3]) then
  local all = redis.call('HGETALL', KEYS[1])
  total = 0
  for i = 1, #all, 2 do
    local name, value = all[i], tonumber(all[i + 1])
    local kind = string.sub(name, 1, 2)
    if kind == 'r:' or kind == 'w:' then
      if value == nil or value * 0.5 < 0.01 then
        redis.call('HDEL', KEYS[1], name)
      else
        redis.call('HSET', KEYS[1], name, string.format('%.17g', value * 0.5))
        total = total + value * 0.5
      end
    end
  end
  redis.call('HSET', KEYS[1], 'n', string.format('%.17g', total))
end
return tostring(total)
