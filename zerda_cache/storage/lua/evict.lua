-- KEYS[1] ids zset  KEYS[2] q hash  KEYS[3] log stream  KEYS[4] stats hash  KEYS[5] cfg hash
-- KEYS[6] evidence set  KEYS[7] state hash  KEYS[8..] entry hashes, one per (id, version)
-- pair in ARGV
-- ARGV[1] reason  ARGV[2] log maxlen  ARGV[3] the worker's lease epoch ('' = not fenced)
-- ARGV[4], ARGV[5], ...: entry id, expected version ('' = any).
-- returns one status per entry: 1 removed; 0 already gone (stray index entries cleaned);
-- -1 changed since it was scored (kept); an error FENCED (nothing written) when a worker
-- with a newer lease epoch has written to this tenant.
-- Removes an entry from every structure at once: hash, state, ids, exact-match map,
-- replicas' indexes (a 'del' event in the log) and the byte count. A corrupt entry can
-- always be removed: an unconditional removal reads its state only for its size, and
-- takes that from its doc and vec when the state does not say.
if zc_fenced(KEYS[5], ARGV[3]) then
  return redis.error_reply('FENCED a worker with a newer lease wrote to this tenant')
end
local reason, maxlen = ARGV[1], ARGV[2]
local out = {}
local removed, freed = 0, 0
local gone_ids, gone_here = {}, {}  -- removed here: out of the ids zset and the evidence
-- set at the end, in one call each
for i = 8, #KEYS do
  local id, want = ARGV[(i - 8) * 2 + 4], ARGV[(i - 8) * 2 + 5]
  local key = KEYS[i]
  local raw = zc_raw_state(KEYS[7], key, id, nil)
  local dg = redis.pcall('HGET', key, 'dg')
  local other_type = type(dg) == 'table'  -- not a hash (hand-made damage): removed too
  if other_type then
    dg = nil
  end
  -- whatever a corrupt entry lost, it exists while it has its state or a field
  local exists = raw or dg or other_type or redis.call('EXISTS', key) == 1
  local version, size  -- read without the checks: a corrupt state is removed all the same
  if raw and #raw == ZC_STATE_BYTES then
    local fields = {struct.unpack(ZC_STATE, raw)}
    version, size = fields[9], fields[15]
  end
  local changed = false
  if exists and want ~= '' then
    changed = version ~= tonumber(want)
  end
  if not exists and gone_here[id] then  -- the same id twice in one batch
    out[#out + 1] = 0
  elseif not exists then
    redis.call('SREM', KEYS[6], id)
    if redis.call('ZREM', KEYS[1], id) == 1 then
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', maxlen, '*', 'op', 'del', 'id', id)
    end
    out[#out + 1] = 0
  elseif changed then
    out[#out + 1] = -1
  else
    if other_type then
      size = 0  -- never counted: the put script wrote a hash
    elseif not (size and size >= 0 and size < 2 ^ 53 and size % 1 == 0) then
      -- a state that does not say: what its size counts, read before the DEL
      size = redis.call('HSTRLEN', key, 'doc') + redis.call('HSTRLEN', key, 'vec')
    end
    redis.call('DEL', key)
    if raw then  -- at once, so that the state never outlives the hash (see below)
      redis.call('HDEL', KEYS[7], id)
    end
    gone_ids[#gone_ids + 1] = id
    gone_here[id] = true
    if dg and redis.call('HGET', KEYS[2], dg) == id then
      redis.call('HDEL', KEYS[2], dg)
    end
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', maxlen, '*', 'op', 'del', 'id', id)
    removed = removed + 1
    freed = freed + size
    out[#out + 1] = 1
  end
end
-- One ZREM and one SREM for the batch rather than a call of each per entry (with no EXISTS
-- for an entry that has a field): less of the server's time at 1M entries. In chunks,
-- within Lua's limit on unpack. A script error earlier in the batch would leave the ids
-- of the entries it removed before it in both: the next whole scan finds them dangling
-- and removes them (a second 'del' event, which replicas ignore). A key of the wrong type
-- is no such error: it is read with pcall and removed as corrupt.
for at = 1, #gone_ids, 1000 do
  local last = math.min(at + 999, #gone_ids)
  redis.call('ZREM', KEYS[1], unpack(gone_ids, at, last))
  redis.call('SREM', KEYS[6], unpack(gone_ids, at, last))
end
if removed > 0 then
  redis.call('HINCRBY', KEYS[4], 'evicted:' .. reason, removed)
end
if freed > 0 then  -- never -0, which HINCRBY refuses
  redis.call('HINCRBY', KEYS[4], 'bytes', -freed)
end
return out
