-- KEYS[1..n] entry hashes of one tenant.  ARGV: none.  Reads only.
-- returns 3 values per key, flat: the raw 'arm', 'use' and 'sz' fields (false where a
-- field is missing; all three false: the entry is gone).
-- One command per batch of the worker's scan. The decoding and the checks (the library's
-- zc_state) happen in the worker (plans.decode_states): Redis runs on one core, and the
-- worker scores one batch while the next is read, so the decoding costs no server time.
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'arm', 'use', 'sz')
  local base = 3 * (i - 1)
  out[base + 1], out[base + 2], out[base + 3] = v[1], v[2], v[3]
end
return out
