-- KEYS[1] ids zset  KEYS[2] q hash  KEYS[3] log stream  KEYS[4..] entry hashes
-- ARGV[1] log maxlen  ARGV[2..] the entry ids of KEYS[4..], in order
-- returns how many entries were taken back
-- Takes back entries whose hash survived the loss of the tenant's ids zset (an allkeys-*
-- eviction of the key, or a DEL): without an id in the zset an entry is never served,
-- indexed or evicted. Each orphan gets its id back with its expiry (created + ttl, or
-- none; an unreadable meta expires it now, so the next cycle evicts it), its exact-match
-- digest if no other entry holds it, and an 'add' event for the replicas' indexes.
-- An entry already in the zset, or gone, is left alone.
local adopted = 0
for i = 4, #KEYS do
  local key, id = KEYS[i], ARGV[i - 2]
  if redis.call('EXISTS', key) == 1 and not redis.call('ZSCORE', KEYS[1], id) then
    local raw = redis.call('HMGET', key, 'meta', 'dg')
    local ok, meta = pcall(cmsgpack.unpack, raw[1] or '')
    local expires, scope = '0', ''
    if ok and type(meta) == 'table' and tonumber(meta.ct) then
      local ttl = tonumber(meta.ttl) or 0
      expires = ttl > 0 and string.format('%.17g', meta.ct + ttl) or '+inf'
      scope = type(meta.sc) == 'string' and meta.sc or ''
    end
    redis.call('ZADD', KEYS[1], expires, id)
    if raw[2] and not redis.call('HGET', KEYS[2], raw[2]) then
      redis.call('HSET', KEYS[2], raw[2], id)
    end
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', 'op', 'add', 'id', id, 'sc', scope)
    adopted = adopted + 1
  end
end
return adopted
