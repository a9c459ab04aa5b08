-- KEYS[1..n] entry hashes of one tenant.  ARGV: none.  Reads only.
-- returns 3n values: each key's arm, use and sz fields as stored (nil where missing).
-- One command reads a whole batch of the worker's scan. The values are decoded and
-- checked by the worker (codec.state_columns), not here: decoding two msgpack maps per
-- entry and checking every field more than doubled this script's time in the server's
-- one thread (~14 against ~6 us an entry), which every lookup of every replica waits
-- behind.
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'arm', 'use', 'sz')
  out[3 * i - 2], out[3 * i - 1], out[3 * i] = v[1], v[2], v[3]
end
return out
