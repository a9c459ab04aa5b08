-- KEYS[1] an entry hash with a dispute (dispute.lua)  KEYS[2] the tenant's cal hash
-- ARGV[1] 1 = the entry's answer was right after all (the next answer agreed with it),
-- 0 = it stands as wrong  ARGV[2] the exact repeats' label suffix of its level (e, e<k>)
-- returns 1 if a dispute was resolved, 0 if there was none (resolved meanwhile)
-- Takes the dispute away once, and with ARGV[1] = 1 turns the wrong label it was counted
-- as into a right one (at most one label: halving may have made it worth less). The
-- label total stays.
if redis.call('HDEL', KEYS[1], 'dsp') == 0 then
  return 0
end
if ARGV[1] == '1' then
  local wrong = 'w:' .. ARGV[2]
  local moved = math.min(1, tonumber(redis.call('HGET', KEYS[2], wrong) or '0') or 0)
  if moved > 0 then
    redis.call('HINCRBYFLOAT', KEYS[2], wrong, -moved)
    redis.call('HINCRBYFLOAT', KEYS[2], 'r:' .. ARGV[2], moved)
    redis.call('HINCRBY', KEYS[2], 'lv', 1)  -- the label stamp (label.lua)
  end
end
return 1
