-- KEYS[1] the tenant's calibration hash (cal)  KEYS[2] its label log (lab)
-- ARGV[1] score bin (0-based)  ARGV[2] 1 = the cached answer was right, 0 = wrong
-- ARGV[3] window: when the label count passes it, every count is halved
-- ARGV[4] the model version the score was computed with (0: similarity, no model)
-- ARGV[5] the match's features, JSON [similarity, gap, crowd] (null: unknown)
-- ARGV[6] labels the log keeps (0: not logged; the exact repeats' labels, bin 'e' for
-- unconfirmed entries, 'e<k>' for an entry at confirmed level k)
-- returns the tenant's label count after this one (halving included)
-- Every label counted bumps the label stamp lv (read_stamp): replicas re-read the policy
-- within a bounded number of labels, not of seconds.
-- Counts one labelled outcome of a near match (zerda_cache/calibration.py) in the bins of
-- the tenant's model version, and logs it with its features for the worker's next fit
-- (zerda_cache/match_model.py). A label scored under another version (the worker
-- published a model meanwhile) is logged, not counted: the new bins were rescored from
-- the log. Halving keeps the last ~window labels' weight, so the serving threshold
-- follows a drift; counts under 0.01 after halving are dropped. Only the label counts are
-- halved here: the lookup counts (t...) have their own window (traffic.lua).
local version = tonumber(redis.call('HGET', KEYS[1], 'mv') or '0') or 0
local exact = string.sub(ARGV[1], 1, 1) == 'e'  -- never tagged: no score involved
if tonumber(ARGV[6]) > 0 then
  redis.call('LPUSH', KEYS[2], '[' .. ARGV[5] .. ',' .. ARGV[2] .. ']')
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[6]) - 1)
  redis.call('HINCRBY', KEYS[1], 'ln', 1)
end
if not exact and version ~= tonumber(ARGV[4]) then
  return tostring(tonumber(redis.call('HGET', KEYS[1], 'n') or '0') or 0)
end
local tag = (version > 0 and not exact) and tostring(version) or ''
local field = (ARGV[2] == '1' and 'r' or 'w') .. tag .. ':' .. ARGV[1]
redis.call('HINCRBYFLOAT', KEYS[1], field, 1)
redis.call('HINCRBY', KEYS[1], 'lv', 1)
local total = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 'n', 1))
if total > tonumber(ARGV[3]) then
  total = zc_halve(KEYS[1], '^[rw]%d*:', 'n')
end
return tostring(total)
