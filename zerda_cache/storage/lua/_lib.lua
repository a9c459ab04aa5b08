-- KEYS: none. ARGV: none. returns: nothing. Not a script: scripts.py prepends this library
-- to put, hit, feedback, decay, evict, state, label and traffic, so that each formula of
-- zerda_cache/core/entry.py exists once in Lua. Arms are msgpack maps {a=alpha, b=beta, n=pulls, r=reward_sum, t=decayed_at}.

-- The one clock: the caller's injected time (tests) or the Redis server's TIME.
local function zc_now(argv_now)
  if argv_now ~= nil and argv_now ~= '' then
    return tonumber(argv_now)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Fencing tokens: a worker cycle passes its lease epoch (a number that grows with every
-- new leader); the tenant remembers the newest it saw, and a write with an older one is
-- refused, so a leader that stalled past its lease cannot finish its cycle after a new
-- leader took over. '' = a write that is not part of a cycle (never fenced).
local function zc_fenced(cfg_key, epoch)
  if epoch == nil or epoch == '' then
    return false
  end
  local mine = tonumber(epoch)
  local seen = tonumber(redis.call('HGET', cfg_key, 'fence') or '0') or 0
  if mine < seen then
    return true
  end
  if mine > seen then
    redis.call('HSET', cfg_key, 'fence', epoch)
  end
  return false
end

-- msgpack-decode a stored value; nil (never an error) when it is missing or corrupt, so
-- that one bad entry cannot abort a batch halfway through its writes.
local function zc_unpack(raw)
  if not raw then
    return nil
  end
  local ok, val = pcall(cmsgpack.unpack, raw)
  if not ok or type(val) ~= 'table' then
    return nil
  end
  return val
end

-- Every field a finite number (NaN ~= NaN; an infinity is as corrupt as a NaN: it turns
-- into NaN at the next division). One test of the fields' sum: NaN and infinities carry
-- into it (inf - inf is NaN). The worker's scan checks the same in Python
-- (codec.state_columns), off the server's thread.
local ZC_INF = math.huge
local function zc_all_numbers(tbl, fields)
  if not tbl then
    return false
  end
  local sum = 0
  for i = 1, #fields do
    local x = tbl[fields[i]]
    if type(x) ~= 'number' then
      return false
    end
    sum = sum + x
  end
  return sum == sum and sum ~= ZC_INF and sum ~= -ZC_INF
end

local ZC_ARM_FIELDS = {'a', 'b', 'n', 'r', 't'}
local ZC_USE_FIELDS = {'n', 'la', 'c', 'v', 'ss', 'qs', 'sb', 'pm'}

-- The run of complaints: absent (0) or a whole number >= 0.
local function zc_valid_streak(ns)
  return ns == nil or (type(ns) == 'number' and ns >= 0 and ns < 1e9 and ns % 1 == 0)
end

-- An LLM call's usage as core/entry.py's LLMUsage takes it: {model, prompt tokens,
-- completion tokens}, the model 1-128 printable ASCII characters, the token counts whole
-- numbers in [0, 2^31). The one test of a usage: a meta holding another is corrupt.
local function zc_whole(x, low, high)
  return type(x) == 'number' and x == x and x >= low and x <= high and x % 1 == 0
end
local function zc_list_of(tbl, kind, n)
  -- a msgpack array of `n` (nil: any number of) values of Lua type `kind`
  if type(tbl) ~= 'table' or (n and #tbl ~= n) then
    return false
  end
  local count = 0
  for _, v in pairs(tbl) do
    count = count + 1
    if kind and type(v) ~= kind then
      return false
    end
  end
  return count == #tbl
end
local function zc_sound_usage(us)
  if not zc_list_of(us, nil, 3) then
    return false
  end
  local model = us[1]
  return type(model) == 'string' and #model >= 1 and #model <= 128
      and not string.find(model, '[^\32-\126]')
      and zc_whole(us[2], 0, 2^31 - 1) and zc_whole(us[3], 0, 2^31 - 1)
end

-- An entry's meta, decoded, if codec.unpack_meta reads it: schema version 1; ct and ttl
-- finite; dim a whole number >= 1; sc absent or a string; tg absent or a list of
-- strings; us absent or a sound usage (zc_sound_usage). nil otherwise, and then a second
-- value, true, when the meta is only of another schema version (a newer zerda-cache's:
-- SchemaVersionError, never reported for eviction). A script that serves an entry (hit)
-- or writes its arm (feedback) refuses one whose meta the replicas refuse.
local function zc_sound_meta(raw)
  local meta = zc_unpack(raw)
  if not meta then
    return nil
  end
  if meta.v ~= 1 then
    return nil, true
  end
  if not zc_all_numbers(meta, {'ct', 'ttl'}) or not zc_whole(meta.dim, 1, 2^31 - 1)
      or not (meta.sc == nil or type(meta.sc) == 'string')
      or not (meta.tg == nil or zc_list_of(meta.tg, 'string'))
      or not (meta.us == nil or zc_sound_usage(meta.us)) then
    return nil
  end
  return meta
end

-- An entry's learning state is one field of the tenant's state hash (`st`, field: the
-- entry id): 15 little-endian float64, 120 bytes (ZC_STATE):
--   arm: a=alpha, b=beta, n=pulls, r=reward_sum, t=decayed_at
--   use: n=uses, la=last access, c=confidence, v=version, ss=similarity, qs=quality,
--        sb=the entry's own similarity bar, pm=lowest similarity of a positive signal,
--        ns=negative signals in a row
--   sz: bytes of doc + vec
-- One hash for the tenant rather than fields of each entry's own hash, so that the
-- worker's whole scan reads a batch of states from one key; fixed-width numbers rather
-- than msgpack maps, so that the worker decodes a batch as one array (codec.state_columns)
-- instead of decoding msgpack an entry at a time (docs/design.md, "The worker's cycle").
local ZC_STATE = '<' .. string.rep('d', 15)
local ZC_STATE_BYTES = 120

-- `arm` and `use` as tables, checked (zc_all_numbers and the rest of zc_state's tests);
-- nil, nil if either is not.
local function zc_valid_state(arm, use)
  if type(arm) == 'table' and type(use) == 'table'
      and zc_all_numbers(arm, ZC_ARM_FIELDS) and zc_all_numbers(use, ZC_USE_FIELDS)
      and arm.a > 0 and arm.b > 0 and zc_valid_streak(use.ns) then
    return arm, use
  end
  return nil, nil
end

local function zc_pack_state(arm, use, size)
  return struct.pack(ZC_STATE, arm.a, arm.b, arm.n, arm.r, arm.t, use.n, use.la, use.c,
                     use.v, use.ss, use.qs, use.sb, use.pm, use.ns or 0, size)
end

-- Decode a raw state: arm, use and sz; nil if it is missing or corrupt (not 120 bytes, a
-- field that is not finite, alpha or beta not positive, a run of negatives that is not a
-- whole number). sz comes as stored, unchecked: only the worker's scan uses it (NaN:
-- unknown). A run of 0 reads as absent, as in the maps a script returns.
local function zc_state(raw)
  if not raw or #raw ~= ZC_STATE_BYTES then
    return nil
  end
  local a, b, n, r, t, un, la, c, v, ss, qs, sb, pm, ns, size = struct.unpack(ZC_STATE, raw)
  local arm = {a = a, b = b, n = n, r = r, t = t}
  local use = {n = un, la = la, c = c, v = v, ss = ss, qs = qs, sb = sb, pm = pm}
  if ns ~= 0 then
    use.ns = ns
  end
  arm, use = zc_valid_state(arm, use)
  if not arm then
    return nil
  end
  return arm, use, size
end

-- BanditArm.decay_to: shrink the excess over the prior for the time since arm.t. An arm
-- without evidence (at its prior) has nothing to shrink and is left as it is.
local function zc_decay(arm, now, prior_a, prior_b, decay, interval)
  if now > arm.t and math.abs(arm.a - prior_a) + math.abs(arm.b - prior_b) > 1e-12 then
    local factor = decay ^ ((now - arm.t) / interval)
    arm.a = prior_a + (arm.a - prior_a) * factor
    arm.b = prior_b + (arm.b - prior_b) * factor
    arm.t = now
  end
end

-- entry.compute_confidence
local function zc_confidence(arm, use)
  local expected = arm.a / (arm.a + arm.b)
  local cred = math.log(1.0 + use.n) / math.log(1.0 + 50)
  if cred > 1.0 then
    cred = 1.0
  end
  local raw = 0.40 * expected + 0.25 * use.ss + 0.25 * use.qs + 0.10 * cred
  if raw < 0.0 then
    return 0.0
  elseif raw > 1.0 then
    return 1.0
  end
  return raw
end

-- The raw state of entry `id` (hash `key`), or nil when it has none. With `prior` (a
-- script that writes the state: {a = prior alpha, b = prior beta, now = now}):
-- * an entry written by zerda-cache 0.1 holds msgpack `arm` and `use` maps and `sz` in its
--   own hash: they move to the state hash here, with their values (an arm or use that
--   does not decode, or is corrupt, moves as a corrupt state: one byte; a size that is
--   not a number as NaN). Without `prior` they are only read.
-- * an entry whose hash exists without any state (the state hash was lost: an allkeys-*
--   eviction of the key, a DEL) gets the state a put gives (the prior; similarity and
--   quality at their defaults, entry.DEFAULT_SIMILARITY and DEFAULT_QUALITY): it lost its
--   evidence, not its answer; its hit numbers start over, so the marks of its wrong
--   hits (`wh`, feedback.lua) go too.
local function zc_raw_state(st_key, key, id, prior)
  local raw = redis.call('HGET', st_key, id)
  if raw then
    return raw
  end
  local old = redis.pcall('HMGET', key, 'arm', 'use', 'sz')
  if old.err then  -- a key of another type (hand-made damage): a corrupt state
    return 'x'
  end
  if old[1] or old[2] or old[3] then
    local arm, use = zc_valid_state(zc_unpack(old[1]), zc_unpack(old[2]))
    raw = arm and zc_pack_state(arm, use, tonumber(old[3]) or 0 / 0) or 'x'
    if prior then
      redis.call('HSET', st_key, id, raw)
      redis.call('HDEL', key, 'arm', 'use', 'sz')
    end
    return raw
  end
  if not prior or redis.call('EXISTS', key) == 0 then
    return nil
  end
  local arm = {a = prior.a, b = prior.b, n = 0, r = 0, t = prior.now}
  local use = {n = 0, la = prior.now, c = 0, v = 1, ss = 1, qs = 0.5, sb = 0, pm = 2}
  use.c = zc_confidence(arm, use)
  local size = redis.call('HSTRLEN', key, 'doc') + redis.call('HSTRLEN', key, 'vec')
  raw = zc_pack_state(arm, use, size)
  redis.call('HSET', st_key, id, raw)
  redis.call('HDEL', key, 'wh')  -- its hits are counted from 1 again (feedback.lua)
  return raw
end

-- Halve every count of a calibration hash whose field matches `pattern` (the labels'
-- r:/w:, or the lookups' t:), dropping those under 0.01, and store their new sum in
-- `total_field`; returns that sum. Old evidence fades, so the bound follows a drift.
local function zc_halve(key, pattern, total_field, part_of)
  -- part_of: fields that are halved but not added to the total (a part of another)
  local all = redis.call('HGETALL', key)
  local total = 0
  for i = 1, #all, 2 do
    local name, value = all[i], tonumber(all[i + 1])
    if string.find(name, pattern) then
      if value == nil or value * 0.5 < 0.01 then
        redis.call('HDEL', key, name)
      else
        redis.call('HSET', key, name, string.format('%.17g', value * 0.5))
        if not (part_of and string.find(name, part_of)) then
          total = total + value * 0.5
        end
      end
    end
  end
  redis.call('HSET', key, total_field, string.format('%.17g', total))
  return total
end

-- The parts of a question's sketch (learning/text_match.py's ``sketch``, rule for rule,
-- on ASCII: %w, %u and %s are the C locale's): its numbers and names as sets, and
-- whether it negates ('1' or '0'). Sets, never sorted strings: a server's collation
-- (LC_COLLATE) need not be byte order.
local ZC_NEGATIONS = {
  ['not'] = true, ['no'] = true, ['never'] = true, ['without'] = true, ['cannot'] = true,
  ['nor'] = true, ['neither'] = true, ['none'] = true, ['nothing'] = true, ['nobody'] = true,
}
local function zc_text_parts(text)
  text = (string.gsub(text, '\226\128\153', "'"))  -- a right single quote
  local numbers, names, negation = {}, {}, '0'
  local last = 0  -- where the previous token ended
  for at, tok in string.gmatch(text, "()([%w']+)") do
    for run in string.gmatch(tok, '%d+') do
      numbers[run] = true
    end
    local low = string.lower(tok)
    if ZC_NEGATIONS[low] or string.sub(low, -3) == "n't" then
      negation = '1'
    end
    if string.find(tok, '^%u') and tok ~= 'I' and string.sub(tok, 1, 2) ~= "I'" then
      -- the nearest non-blank before the token: in the gap since the last token, else
      -- that token's last character (no sentence end), else none (the text's start)
      local before = string.match(string.sub(text, last + 1, at - 1), '(%S)%s*$')
      local starts = (before == nil and last == 0) or (before ~= nil and string.find('.?!', before, 1, true) ~= nil)
      if not starts then
        names[low] = true
      end
    end
    last = at + #tok - 1
  end
  return numbers, names, negation
end

-- A sketch's parts as sketch() writes them ('a,b'), as a set.
local function zc_text_set(part)
  local set = {}
  for item in string.gmatch(part, '[^,]+') do
    set[item] = true
  end
  return set
end

local function zc_same_set(a, b)
  for k in pairs(a) do
    if not b[k] then
      return false
    end
  end
  for k in pairs(b) do
    if not a[k] then
      return false
    end
  end
  return true
end

-- The differences between a question's sketch and a cached question's text, as the
-- index of their combination (text_match.combo: 1 numbers, 2 names, 4 negation).
local function zc_text_combo(asked, text)
  local a_num, a_names, a_neg = string.match(asked, '^([^|]*)|([^|]*)|([01])$')
  if not a_num then
    return 7  -- not a sketch: everything differs
  end
  local numbers, names, negation = zc_text_parts(text)
  local index = 0
  if not zc_same_set(zc_text_set(a_num), numbers) then
    index = index + 1
  end
  if not zc_same_set(zc_text_set(a_names), names) then
    index = index + 2
  end
  if a_neg ~= negation then
    index = index + 4
  end
  return index
end

-- The usage of an entry whose meta zc_sound_meta passed (meta.us, put.lua: {model,
-- prompt tokens, completion tokens}) as the savings' stats fields take it
-- (savings.FIELDS): the model and the two counts as integer strings for HINCRBY; nil
-- when the entry has none.
local function zc_usage(meta)
  local us = meta.us
  if us == nil then
    return nil
  end
  return us[1], string.format('%.0f', us[2]), string.format('%.0f', us[3])
end

-- Add one call of `model` with its tokens to the stats hash's `kind` fields ("saved" or
-- "wrong", savings.FIELDS).
local function zc_count_usage(stats, kind, model, prompt, completion)
  local f = kind .. ':' .. model .. ':'
  redis.call('HINCRBY', stats, f .. 'calls', 1)
  redis.call('HINCRBY', stats, f .. 'prompt', prompt)
  redis.call('HINCRBY', stats, f .. 'completion', completion)
end
