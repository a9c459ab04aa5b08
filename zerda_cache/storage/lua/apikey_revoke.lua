-- KEYS[1] the API keys hash (apikeys)
-- ARGV[1] 'id' or 'tenant'  ARGV[2] the key id (12 hex digits) or the tenant id
-- ARGV[3] now (unix seconds)
-- returns the ids of the keys revoked by this call (already revoked ones are not listed)
-- Marks matching active keys revoked (the record stays, so listings show it and a client
-- still sending the token is told it was revoked). A linear pass over the hash: keys are
-- few (one or a handful per tenant) and this runs only from the CLI.
local all = redis.call('HGETALL', KEYS[1])
local field = ARGV[1]
local out = {}
for i = 1, #all, 2 do
  local ok, record = pcall(cjson.decode, all[i + 1])
  if ok and type(record) == 'table' and record[field] == ARGV[2]
      and (record['revoked'] == nil or record['revoked'] == cjson.null) then
    record['revoked'] = tonumber(ARGV[3])
    redis.call('HSET', KEYS[1], all[i], cjson.encode(record))
    out[#out + 1] = record['id']
  end
end
return out
