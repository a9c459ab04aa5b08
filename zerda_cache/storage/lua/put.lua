-- KEYS[1] entry hash  KEYS[2] ids zset  KEYS[3] q hash  KEYS[4] log stream  KEYS[5] stats hash
-- KEYS[6] cfg hash  KEYS[7] state hash  KEYS[8] the tenant's tag names
-- KEYS[9 .. 8+N] the sets of the entry's N tags (ARGV[16]); KEYS[8..] and ARGV[16..] are
-- left out by a put with neither tags nor usage.  ARGV: see below.
-- returns {1, displaced_id or '', created_at (string)}
-- stored; {-1, tenant_dim} dimension mismatch; {-2} an entry with this id already exists;
-- {-3} the tenant's dimension is lost and unknown to the caller (see ARGV[15]);
-- {-4} the dispute it approves was settled meanwhile (see KEYS[9+N]).
-- ARGV[1] now ('' = server TIME)  ARGV[2] entry id  ARGV[3] doc (msgpack)
-- ARGV[4] vec (codec.encode_vector: by default 'h' then float16 bytes, or float32 bytes)
-- ARGV[5] dim  ARGV[6] digest of (normalised query, scope)
-- ARGV[7] scope  ARGV[8] ttl_s from the caller ('' = none given)  ARGV[9] similarity
-- ARGV[10] quality  ARGV[11] prior_alpha  ARGV[12] prior_beta
-- ARGV[13] log maxlen (approximate)  ARGV[14] the configured default ttl_s (0 = none)
-- ARGV[15] the dimension the caller's index holds for the tenant ('' = none): when the
-- cfg hash was lost (evicted by an allkeys-* policy, a DEL) while entries remain, it
-- still refuses another dimension. With neither, the reply is {-3} (nothing written):
-- the caller restores the dimension from the entries (dim.lua) and puts again, passing
-- the restored dimension, or its own when the entries hold no majority.
-- ARGV[16] N, the number of tags  ARGV[17 .. 16+N] the tags' names
-- ARGV[17+N] the model of the LLM call that made the answer ('' = no usage given)
-- ARGV[18+N] its prompt tokens  ARGV[19+N] its completion tokens
-- KEYS[9+N] (with ARGV[16 .. 19+N] all sent) and ARGV[20+N]: the entry a reaction
-- approving the dispute on it replaces (PutSteps.react_flow), and that dispute's nonce.
-- The answer is stored only while that entry still carries that dispute (not one
-- recorded since), else the reply is {-4} (settled meanwhile; nothing written): the
-- dispute stays until this put is done (the entry held out of near matches meanwhile),
-- and goes with the entry's hash when it is evicted after; a put refused (a full
-- server) leaves it for a retried reaction.
-- The TTL is the caller's, else the tenant's override (cfg 'ttl'), else the default.
-- Whether a dispute as dispute.lua wrote it (msgpack [level, answer, settings, nonce];
-- false: none) is the one ``nonce`` names ('' names one written without a nonce).
local function dispute_is(raw, nonce)
  if not raw then
    return false
  end
  local ok, dispute = pcall(cmsgpack.unpack, raw)
  return ok and type(dispute) == 'table' and (dispute[4] or '') == nonce
end

local now = zc_now(ARGV[1])
local id, dim, digest, scope = ARGV[2], tonumber(ARGV[5]), ARGV[6], ARGV[7]

-- The tenant's dimension is fixed by its first put.
local cfg = redis.call('HMGET', KEYS[6], 'dim', 'ttl')
local tenant_dim = cfg[1]
local ttl = tonumber(ARGV[8]) or tonumber(cfg[2]) or tonumber(ARGV[14]) or 0
if tenant_dim and tonumber(tenant_dim) ~= dim then
  return {-1, tonumber(tenant_dim)}
end
if not tenant_dim and redis.call('ZCARD', KEYS[2]) > 0 then
  if ARGV[15] == '' then
    return {-3}
  end
  if tonumber(ARGV[15]) ~= dim then
    return {-1, tonumber(ARGV[15])}
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {-2}
end
local n_tags = tonumber(ARGV[16]) or 0
local approves = KEYS[9 + n_tags]
if approves and not dispute_is(redis.call('HGET', approves, 'dsp'), ARGV[20 + n_tags]) then
  return {-4}
end
if not tenant_dim then
  redis.call('HSET', KEYS[6], 'dim', dim)
end

local meta = {v = 1, ct = now, ttl = ttl, sc = scope, dim = dim}
if n_tags > 0 then
  local tags = {}
  for i = 1, n_tags do
    tags[i] = ARGV[16 + i]
  end
  meta.tg = tags
end
local usage_model = ARGV[17 + n_tags]
if usage_model and usage_model ~= '' then
  meta.us = {usage_model, tonumber(ARGV[18 + n_tags]), tonumber(ARGV[19 + n_tags])}
end
local arm = {a = tonumber(ARGV[11]), b = tonumber(ARGV[12]), n = 0, r = 0, t = now}
local use = {n = 0, la = now, c = 0, v = 1, ss = tonumber(ARGV[9]), qs = tonumber(ARGV[10]),
             sb = 0, pm = 2}
use.c = zc_confidence(arm, use)
local size = #ARGV[3] + #ARGV[4]

redis.call('HSET', KEYS[1], 'doc', ARGV[3], 'vec', ARGV[4], 'meta', cmsgpack.pack(meta),
           'dg', digest)
redis.call('HSET', KEYS[7], id, zc_pack_state(arm, use, size))
local expires = '+inf'
if ttl > 0 then
  expires = string.format('%.17g', now + ttl)
end
redis.call('ZADD', KEYS[2], expires, id)
for i = 1, n_tags do
  redis.call('SADD', KEYS[8 + i], id)
  redis.call('SADD', KEYS[8], ARGV[16 + i])
end
local displaced = redis.call('HGET', KEYS[3], digest)
redis.call('HSET', KEYS[3], digest, id)
if not displaced or displaced == id then
  displaced = ''
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[13], '*', 'op', 'add', 'id', id, 'sc', scope)
redis.call('HINCRBY', KEYS[5], 'puts', 1)
redis.call('HINCRBY', KEYS[5], 'bytes', size)
return {1, displaced, string.format('%.17g', now)}
