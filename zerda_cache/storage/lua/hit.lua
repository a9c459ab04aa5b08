-- KEYS[1] entry hash  KEYS[2] ids zset  KEYS[3] stats hash  KEYS[4] state hash
-- KEYS[5] the set of ids for the worker to evict (`bad`)
-- KEYS[6] the exact-match map (only with ARGV[10])
-- ARGV[1] now ('' = server TIME)  ARGV[2] entry id  ARGV[3] prior_alpha  ARGV[4] prior_beta
-- ARGV[5] usage_decay  ARGV[6] decay_interval_s  ARGV[7] refresh TTL (1/0)
-- ARGV[8] the serving bar of the expected reward ('' = serve whatever the reward)
-- ARGV[9] the similarity this entry matched at ('' = unknown)
-- ARGV[10] the digest of the question asked ('' = not a speculative near match)
-- ARGV[11] the bar of the question's own entry ('' = none)
-- returns {1, arm, use, doc, meta} served (msgpack values); {0} gone; {-1} expired;
-- {-3} corrupt state (or its hash lost while its state and id remain: reported in `bad`); {-4, expected reward at now} expected reward below the bar; {-5}
-- similarity below the entry's own learned bar; {-6} the question asked has an entry of
-- its own, another one (nothing written, not served, for -4, -5 and -6).
-- With a digest (a lookup serving its best near match before it knows whether the
-- question is cached itself): if the digest names another entry, that one is the
-- lookup's to rank first, so this one is not served; if it names this one, it is served
-- as the question's own entry (similarity 1, and its own bar too).
-- Serving an entry: bring its arm to now, count the use, recompute confidence, bump the
-- version (eviction skips entries whose version moved since they were scored).
local now = zc_now(ARGV[1])
local id = ARGV[2]
local score = redis.call('ZSCORE', KEYS[2], id)
local raw = redis.call('HMGET', KEYS[1], 'meta', 'doc')
local state = zc_raw_state(KEYS[4], KEYS[1], id,
                           {a = tonumber(ARGV[3]), b = tonumber(ARGV[4]), now = now})
if not score or not (state or raw[1] or raw[2]) then
  return {0}
end
if tonumber(score) <= now then
  return {-1}
end
local bar, similarity = tonumber(ARGV[8]), tonumber(ARGV[9])
if ARGV[10] and ARGV[10] ~= '' then
  local own = redis.call('HGET', KEYS[6], ARGV[10])
  if own and own ~= id then
    return {-6}
  end
  if own then
    similarity = 1
    local own_bar = tonumber(ARGV[11])
    if own_bar and (not bar or own_bar > bar) then
      bar = own_bar
    end
  end
end
local arm, use, size = zc_state(state)
if not arm then
  return {-3}
end
if not (raw[1] or raw[2]) then
  -- The entry's hash is gone (an allkeys-* eviction, a DEL) while its id and state remain:
  -- the worker's scan reads states, not hashes, so this lookup reports it for eviction.
  redis.call('SADD', KEYS[5], id)
  return {-3}
end
zc_decay(arm, now, tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
local reward = arm.a / (arm.a + arm.b)
if bar and reward < bar then
  return {-4, string.format('%.17g', reward)}
end
if similarity and similarity < use.sb then
  return {-5}
end
if ARGV[7] == '1' then
  local meta = zc_unpack(raw[1])
  if not meta or type(meta.ttl) ~= 'number' then
    return {-3}
  end
  if meta.ttl > 0 then
    redis.call('ZADD', KEYS[2], 'XX', string.format('%.17g', now + meta.ttl), id)
  end
end
use.n = use.n + 1
if now > use.la then
  use.la = now
end
use.v = use.v + 1
use.c = zc_confidence(arm, use)
local packed_arm, packed_use = cmsgpack.pack(arm), cmsgpack.pack(use)
redis.call('HSET', KEYS[4], id, zc_pack_state(arm, use, size))
redis.call('HINCRBY', KEYS[3], 'hits', 1)
return {1, packed_arm, packed_use, raw[2], raw[1]}
