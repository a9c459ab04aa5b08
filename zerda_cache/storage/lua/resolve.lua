-- KEYS[1] an entry hash with a dispute (dispute.lua)  KEYS[2] the tenant's cal hash
-- ARGV[1] 1 = the entry's answer was right after all (the next answer agreed with it, or
-- the user turned the disputed answer down), 0 = it stands as wrong
-- ARGV[2] the exact repeats' label suffix of the level the dispute recorded (e, e<k>:
-- tenant_plans.exact_bin)
-- ARGV[3] the dispute's nonce (its payload's 4th field; '' = one written without)
-- returns 1 if the dispute was resolved, 0 if there was none, or another one (resolved
-- meanwhile, and another answer disputed the entry since)
-- Takes the dispute away once, and with ARGV[1] = 1 turns the wrong label it was counted
-- as into a right one (at most one label: halving may have made it worth less). The
-- label total stays. A reaction or verification settles only the dispute it answers.
local raw = redis.call('HGET', KEYS[1], 'dsp')
if not raw then
  return 0
end
local ok, dispute = pcall(cmsgpack.unpack, raw)
if not (ok and type(dispute) == 'table' and (dispute[4] or '') == ARGV[3]) then
  return 0
end
redis.call('HDEL', KEYS[1], 'dsp')
if ARGV[1] == '1' then
  local suffix = ARGV[2]
  local wrong = 'w:' .. suffix
  local moved = math.min(1, tonumber(redis.call('HGET', KEYS[2], wrong) or '0') or 0)
  if moved > 0 then
    redis.call('HINCRBYFLOAT', KEYS[2], wrong, -moved)
    redis.call('HINCRBYFLOAT', KEYS[2], 'r:' .. suffix, moved)
    redis.call('HINCRBY', KEYS[2], 'lv', 1)  -- the label stamp (label.lua)
  end
end
return 1
