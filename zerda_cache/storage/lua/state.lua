-- KEYS[1..n] entry hashes of one tenant.  ARGV: none.  Reads only.
-- returns one msgpack array of 9 numbers per key: status (1 ok, 0 gone, -1 corrupt), alpha,
-- beta, decayed_at, uses, last access, confidence, version, size (zeros unless ok).
-- One call reads and decodes a whole batch, so the worker's scan costs one command and
-- one msgpack decode per batch instead of one per entry.
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'arm', 'use', 'sz')
  local base = 9 * (i - 1)
  local status, arm, use, size = 0, nil, nil, nil
  if v[1] or v[2] or v[3] then  -- the entry exists (a missing arm makes it corrupt)
    arm, use = zc_state(v[1], v[2])
    size = tonumber(v[3])
    status = (arm and size) and 1 or -1
  end
  out[base + 1] = status
  if status == 1 then
    out[base + 2], out[base + 3], out[base + 4] = arm.a, arm.b, arm.t
    out[base + 5], out[base + 6], out[base + 7], out[base + 8] = use.n, use.la, use.c, use.v
    out[base + 9] = size
  else
    for j = 2, 9 do
      out[base + j] = 0
    end
  end
end
return cmsgpack.pack(out)
