-- KEYS[1] the API keys hash (apikeys)
-- ARGV[1] the token's SHA-256 digest (hex)  ARGV[2] the key's record (JSON)
-- returns 1 = stored, 0 = a key with this digest exists already (left as it was)
-- A digest is never reused: a revoked key's record stays, so its token stays refused.
return redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
