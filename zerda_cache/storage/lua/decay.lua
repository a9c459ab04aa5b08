-- KEYS[1] the tenant's cfg hash (its fence)  KEYS[2] evidence set  KEYS[3] state hash
-- KEYS[4..n] entry hashes
-- ARGV[1] now ('' = server TIME)  ARGV[2] prior_alpha  ARGV[3] prior_beta  ARGV[4] usage_decay
-- ARGV[5] decay_interval_s  ARGV[6] the worker's lease epoch ('' = not fenced)
-- ARGV[7] '1': a full scan of the tenant ended, the evidence set is complete (cfg 'evx')
-- ARGV[8..] the entry ids of KEYS[4..], in order
-- returns {decayed, missing, {indexes of corrupt keys, 1 = KEYS[4]}}; an error FENCED
-- (nothing written) when a worker with a newer lease epoch has written to this tenant.
-- Brings every arm to now and persists it (with its confidence). Time-based and
-- idempotent: an arm already at now, or at its prior (no evidence to decay), is left as
-- it is. Does not bump the version: the arm's value at any instant is unchanged, only its
-- representation is. Keeps the evidence set (the decay job's work list, filled by the
-- feedback script) right: an arm with evidence joins it, an entry gone leaves it.
if zc_fenced(KEYS[1], ARGV[6]) then
  return redis.error_reply('FENCED a worker with a newer lease wrote to this tenant')
end
local now = zc_now(ARGV[1])
local pa, pb = tonumber(ARGV[2]), tonumber(ARGV[3])
local decay, interval = tonumber(ARGV[4]), tonumber(ARGV[5])
local decayed, missing, corrupt = 0, 0, {}
local prior = {a = pa, b = pb, now = now}
for i = 4, #KEYS do
  local key, id = KEYS[i], ARGV[i + 4]
  local state = zc_raw_state(KEYS[3], key, id, prior)
  if not state then
    missing = missing + 1
    redis.call('SREM', KEYS[2], id)
  else
    local arm, use, size = zc_state(state)
    if not arm then
      corrupt[#corrupt + 1] = i - 3
    else
      local before = arm.t
      zc_decay(arm, now, pa, pb, decay, interval)
      if arm.t ~= before then  -- arms at their prior, or already at now, are not rewritten
        use.c = zc_confidence(arm, use)
        redis.call('HSET', KEYS[3], id, zc_pack_state(arm, use, size))
        redis.call('SADD', KEYS[2], id)
        decayed = decayed + 1
      end
    end
  end
end
if ARGV[7] == '1' then
  redis.call('HSET', KEYS[1], 'evx', '1')
end
return {decayed, missing, corrupt}
