-- KEYS[1] the tenant's snapshot hash (snap)  KEYS[2..] chunk keys (see ARGV)
-- ARGV[1] 'commit' or 'drop'
-- commit: ARGV[2] the generation the caller read ('' = none), ARGV[3] the new generation,
--   ARGV[4] n: KEYS[2..n+1] are the new generation's chunks, written beforehand with a
--   TTL, the other keys the old generation's; ARGV[5..] field/value pairs of the new
--   snapshot hash. Returns 1, or 0 (nothing changed) if another snapshot was committed
--   since the caller read the generation.
-- drop: deletes the hash and every chunk key passed. Returns 1.
-- An index snapshot (zerda_cache/snapshot.py): the worker writes the chunks of a new
-- generation (not yet referenced, so nobody reads them half-written), then this script
-- publishes it and deletes the old one in one step, so a replica reads a whole snapshot
-- or none.
if ARGV[1] == 'drop' then
  for i = 1, #KEYS do
    redis.call('UNLINK', KEYS[i])
  end
  return 1
end
local current = redis.call('HGET', KEYS[1], 'gen') or ''
if current ~= ARGV[2] then
  return 0
end
local n = tonumber(ARGV[4])
for i = 2, n + 1 do
  if redis.call('PERSIST', KEYS[i]) == 0 and redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('ERR snapshot: chunk ' .. KEYS[i] .. ' is missing')
  end
end
for i = n + 2, #KEYS do
  redis.call('UNLINK', KEYS[i])
end
redis.call('DEL', KEYS[1])
local fields = {}
for i = 5, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('HSET', KEYS[1], 'gen', ARGV[3], unpack(fields))
return 1
