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
-- t:e<k> (exact repeats at level k) are a part of t:e: halved, not counted twice
return tostring(zc_halve(KEYS[1], '^t%d*:', 'tn', '^t:e%d+$'))
