-- KEYS[1] entry hash  KEYS[2] ids zset  KEYS[3] q hash  KEYS[4] log stream
-- KEYS[5] stats hash  KEYS[6] cfg hash  KEYS[7] state hash  KEYS[8] evidence set
-- KEYS[9] the tenant's tag names  KEYS[10 .. 9+N] the sets of the entry's N tags
-- ARGV[1] entry id  ARGV[2] doc  ARGV[3] vec  ARGV[4] meta (msgpack)  ARGV[5] digest
-- ARGV[6] scope  ARGV[7] dim  ARGV[8] expiry score ('+inf' = none)  ARGV[9] state
-- (120 bytes)  ARGV[10] size (bytes of doc + vec)  ARGV[11] log maxlen (approximate)
-- ARGV[12] '1' when the arm has evidence  ARGV[13] N  ARGV[14 .. 13+N] the tags' names
-- returns 1 stored; 0 an entry with this id exists (skipped: an import run again resumes);
-- {-1, tenant_dim} dimension mismatch.
-- An exported entry written back whole, as it was: its content, its learning state and
-- its expiry, indexed as a put indexes it (ids, exact-match map, replicas' log, tags).
-- The caller checked every value (codec) and fixed the tenant's dimension first.
local id, dim = ARGV[1], tonumber(ARGV[7])
local tenant_dim = redis.call('HGET', KEYS[6], 'dim')
if tenant_dim and tonumber(tenant_dim) ~= dim then
  return {-1, tonumber(tenant_dim)}
end
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('HEXISTS', KEYS[7], id) == 1 then
  return 0
end
if not tenant_dim then
  redis.call('HSET', KEYS[6], 'dim', dim)
end
redis.call('HSET', KEYS[1], 'doc', ARGV[2], 'vec', ARGV[3], 'meta', ARGV[4], 'dg', ARGV[5])
redis.call('HSET', KEYS[7], id, ARGV[9])
redis.call('ZADD', KEYS[2], ARGV[8], id)
redis.call('HSET', KEYS[3], ARGV[5], id)
if ARGV[12] == '1' then
  redis.call('SADD', KEYS[8], id)
end
local n_tags = tonumber(ARGV[13]) or 0
for i = 1, n_tags do
  redis.call('SADD', KEYS[9 + i], id)
  redis.call('SADD', KEYS[9], ARGV[13 + i])
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[11], '*', 'op', 'add', 'id', id, 'sc', ARGV[6])
redis.call('HINCRBY', KEYS[5], 'imported', 1)
redis.call('HINCRBY', KEYS[5], 'bytes', tonumber(ARGV[10]))
return 1
