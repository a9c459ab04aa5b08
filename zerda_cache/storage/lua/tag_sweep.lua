-- KEYS[1] the set of a tag  KEYS[2] ids zset  KEYS[3] the tenant's tag names
-- ARGV[1] the tag's name  ARGV[2..] ids read from the tag's set
-- returns the number of ids dropped from the tag's set.
-- Entries leave a tag's set when its tag is invalidated, not when the worker evicts them
-- (an eviction does not know an entry's tags without reading it): this drops the given
-- ids that are no longer live, and the tag itself once its set is empty. Checked here,
-- against the ids zset, so a put that tags an entry meanwhile is never undone.
local dropped = 0
for i = 2, #ARGV do
  if not redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    dropped = dropped + redis.call('SREM', KEYS[1], ARGV[i])
  end
end
if redis.call('SCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return dropped
