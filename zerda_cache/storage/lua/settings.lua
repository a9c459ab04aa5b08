-- KEYS[1] the tenant's settings hash (cfg)  KEYS[2] its calibration hash (cal: the label
-- stamp lv is bumped too, so that replicas see a change at their next lookup)
-- ARGV: pairs of (setting name, value); an empty value removes the override
-- returns the tenant's new policy version
-- One change of a tenant's policy (zerda_cache/policy.py): every field and the version
-- bump in one step, so a replica reads all of a change or none of it. Values are
-- validated by the caller (they are the process-independent part of the policy); the
-- names 'dim', 'fence' and 'ver' are the scripts' own and are refused here.
for i = 1, #ARGV, 2 do
  local name, value = ARGV[i], ARGV[i + 1]
  if name == 'dim' or name == 'fence' or name == 'ver' or name == 'updated' or name == 'evx' then
    return redis.error_reply('ERR settings: ' .. name .. ' is not a setting')
  end
end
for i = 1, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], 'updated', redis.call('TIME')[1])
redis.call('HINCRBY', KEYS[2], 'lv', 1)
return redis.call('HINCRBY', KEYS[1], 'ver', 1)
