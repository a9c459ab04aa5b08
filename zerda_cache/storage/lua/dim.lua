-- KEYS[1] cfg hash  KEYS[2] ids zset  KEYS[3..] the entry hashes of a sample of the
-- tenant's live ids (chosen by the caller: a script reaches no key it is not given)
-- ARGV: none
-- returns the tenant's embedding dimension: the cfg hash's 'dim'; when that was lost (an
-- allkeys-* eviction, a DEL) while entries remain, the dimension held by more than half
-- of the sampled entries' vectors, written back to the cfg hash; false when the tenant
-- has no entries or no such majority (then the next put fixes it).
-- Never one entry's word: a corrupt vector alone cannot change a tenant's dimension.
local dim = redis.call('HGET', KEYS[1], 'dim')
if dim then
  return tonumber(dim)
end
if redis.call('ZCARD', KEYS[2]) == 0 then
  return false
end
local votes, voters = {}, 0
local best, most = nil, 0
for i = 3, #KEYS do
  -- pcall: a key of another type (hand-made damage) abstains
  local n = redis.pcall('HSTRLEN', KEYS[i], 'vec')
  if type(n) == 'number' and n > 0 then
    local d
    if n % 2 == 1 then
      d = (n - 1) / 2  -- float16: a marker byte, then 2 bytes a value
    elseif n % 4 == 0 then
      d = n / 4  -- float32
    end
    if d then
      voters = voters + 1
      votes[d] = (votes[d] or 0) + 1
      if votes[d] > most then
        best, most = d, votes[d]
      end
    end
  end
end
if not best or most * 2 <= voters then
  return false
end
redis.call('HSET', KEYS[1], 'dim', best)
return best
