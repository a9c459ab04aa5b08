-- KEYS[1] entry hash  KEYS[2] stats hash  KEYS[3] feedback stream
-- ARGV[1] now ('' = server TIME)  ARGV[2] entry id  ARGV[3] positive (1/0)  ARGV[4] magnitude
-- ARGV[5] positive_feedback_reward  ARGV[6] negative_feedback_penalty  ARGV[7] prior_alpha
-- ARGV[8] prior_beta  ARGV[9] usage_decay  ARGV[10] decay_interval_s
-- ARGV[11] feedback log maxlen (exact)  ARGV[12] source  ARGV[13] caller's timestamp
-- returns {1, arm, use} (msgpack) applied; {0} no such entry; {-3} corrupt state (nothing
-- written). CachePolicyLearner.record_feedback, applied where the arm lives.
local now = zc_now(ARGV[1])
local raw = redis.call('HMGET', KEYS[1], 'arm', 'use', 'meta')
if not raw[1] then
  return {0}
end
local arm, use, meta = zc_state(raw[1], raw[2], raw[3])
if not arm then
  return {-3}
end
local positive = ARGV[3] == '1'
local reward
if positive then
  reward = tonumber(ARGV[4]) * tonumber(ARGV[5])
else
  reward = tonumber(ARGV[4]) * tonumber(ARGV[6])
end
zc_decay(arm, now, tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]))
if positive then
  arm.a = arm.a + reward
  arm.r = arm.r + reward
else
  arm.b = arm.b + reward
  arm.r = arm.r - reward
end
arm.n = arm.n + 1
use.c = zc_confidence(arm, use, meta)
local packed_arm, packed_use = cmsgpack.pack(arm), cmsgpack.pack(use)
redis.call('HSET', KEYS[1], 'arm', packed_arm, 'use', packed_use)
redis.call('HINCRBY', KEYS[1], 'ver', 1)
redis.call('HINCRBY', KEYS[2], positive and 'positive' or 'negative', 1)
redis.call('XADD', KEYS[3], 'MAXLEN', ARGV[11], '*', 'id', ARGV[2], 'pos', ARGV[3],
           'mag', ARGV[4], 'src', ARGV[12], 'ts', ARGV[13])
return {1, packed_arm, packed_use}
