-- KEYS[1] the tenant's calibration hash (cal)
-- ARGV[1] the model version the worker fitted against (its mv when it read the logs)
-- ARGV[2] the new model version  ARGV[3] the model (JSON)  ARGV[4] ln when it read the logs
-- ARGV[5..] pairs: count field (r<v>:<bin>, w<v>:<bin>, t<v>:<bin>, t<v>:x), value
-- returns 1 published, 0 refused (another fit was published meanwhile); with ARGV[2] ''
-- (a fit that was not better than what is in force) it only records ARGV[4] as fit_ln
-- Publishes a match model fitted by the worker (zerda_cache/match_model.py) with the
-- label and lookup counts rescored under it, in one step: every count of older
-- versions goes, so no replica ever reads a model with counts of another. The exact
-- repeats' labels (r:e, w:e, and r:e<k>, w:e<k> per confirmed level) involve no score
-- and stay; their lookups (t:e, t:e<k>) come with the rescored lookups, from the same
-- sample, so that the shares are of one window.
if ARGV[2] == '' then
  redis.call('HSET', KEYS[1], 'fit_ln', ARGV[4])
  return 0
end
local current = tonumber(redis.call('HGET', KEYS[1], 'mv') or '0') or 0
if current ~= tonumber(ARGV[1]) then
  return 0
end
local labels, lookups = 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local name = all[i]
  if string.find(name, '^[rw]:e%d*$') then
    labels = labels + (tonumber(all[i + 1]) or 0)
  elseif string.find(name, '^[rwt]%d*:') then
    redis.call('HDEL', KEYS[1], name)
  end
end
for i = 5, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  if string.find(ARGV[i], '^t:e%d+$') then
    -- exact repeats at a level: a part of t:e, not counted twice
  elseif string.sub(ARGV[i], 1, 1) == 't' then
    lookups = lookups + tonumber(ARGV[i + 1])
  else
    labels = labels + tonumber(ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], 'mv', ARGV[2], 'model', ARGV[3], 'fit_ln', ARGV[4],
  'n', string.format('%.17g', labels), 'tn', string.format('%.17g', lookups))
redis.call('HINCRBY', KEYS[1], 'lv', 1)  -- the label stamp (label.lua)
return 1
