-- KEYS[1] the tenant's cfg hash (its fence)  KEYS[2..n] entry hashes of one tenant
-- ARGV[1] now ('' = server TIME)  ARGV[2] prior_alpha  ARGV[3] prior_beta  ARGV[4] usage_decay
-- ARGV[5] decay_interval_s  ARGV[6] the worker's lease epoch ('' = not fenced)
-- returns {decayed, missing, {indexes of corrupt keys, 1 = KEYS[2]}}; an error FENCED
-- (nothing written) when a worker with a newer lease epoch has written to this tenant.
-- Brings every arm to now and persists it (with its confidence). Time-based and idempotent:
-- an arm already at now, or at its prior (no evidence to decay), is left as it is. Does not bump the version: the arm's value at
-- any instant is unchanged, only its representation is.
if zc_fenced(KEYS[1], ARGV[6]) then
  return redis.error_reply('FENCED a worker with a newer lease wrote to this tenant')
end
local now = zc_now(ARGV[1])
local pa, pb = tonumber(ARGV[2]), tonumber(ARGV[3])
local decay, interval = tonumber(ARGV[4]), tonumber(ARGV[5])
local decayed, missing, corrupt = 0, 0, {}
for i = 2, #KEYS do
  local key = KEYS[i]
  local raw = redis.call('HMGET', key, 'arm', 'use', 'sz')
  if not raw[1] and not raw[2] and not raw[3] then
    missing = missing + 1
  else
    local arm, use = zc_state(raw[1], raw[2])
    if not arm then
      corrupt[#corrupt + 1] = i - 1
    else
      local before = arm.t
      zc_decay(arm, now, pa, pb, decay, interval)
      if arm.t ~= before then  -- arms at their prior, or already at now, are not rewritten
        use.c = zc_confidence(arm, use)
        redis.call('HSET', key, 'arm', cmsgpack.pack(arm), 'use', cmsgpack.pack(use))
        decayed = decayed + 1
      end
    end
  end
end
return {decayed, missing, corrupt}
