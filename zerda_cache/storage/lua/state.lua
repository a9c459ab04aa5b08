-- KEYS[1] the tenant's state hash  KEYS[2..n] entry hashes of one tenant
-- ARGV[1] now ('' = server TIME)  ARGV[2] prior_alpha  ARGV[3] prior_beta
-- ARGV[4] '1': check that each entry's hash exists too (a state without its hash reads as
-- none), for a server whose maxmemory-policy may evict entries' hashes (allkeys-*)
-- ARGV[5..] the entry ids of KEYS[2..], in order.
-- returns n - 1 values: each entry's state as stored (15 float64, lua/_lib.lua; nil
-- where it has none). One call reads a whole batch of the worker's scan with one HMGET of the
-- state hash; the values are decoded and checked by the worker (codec.state_columns), not
-- here, off the server's one thread that every lookup of every replica waits behind. An
-- entry without a state there (written before the state hash, or its state lost) gets it
-- here (zc_raw_state), once.
local n = #ARGV - 4
local out = {}
for at = 1, n, 1000 do
  local last = math.min(at + 999, n)
  local got = redis.call('HMGET', KEYS[1], unpack(ARGV, at + 4, last + 4))
  for j = 1, #got do
    out[at + j - 1] = got[j]
  end
end
local prior
for i = 1, n do
  if not out[i] then
    prior = prior or {a = tonumber(ARGV[2]), b = tonumber(ARGV[3]), now = zc_now(ARGV[1])}
    out[i] = zc_raw_state(KEYS[1], KEYS[i + 1], ARGV[i + 4], prior) or false
  elseif ARGV[4] == '1' and redis.call('EXISTS', KEYS[i + 1]) == 0 then
    out[i] = false
  end
end
return out
