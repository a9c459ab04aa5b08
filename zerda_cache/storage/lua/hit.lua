-- KEYS[1] entry hash  KEYS[2] ids zset  KEYS[3] stats hash  KEYS[4] state hash
-- KEYS[5] the set of ids for the worker to evict (`bad`)
-- KEYS[6] the exact-match map  KEYS[7] the tenant's log (both only with ARGV[10])
-- KEYS[#KEYS] (only with ARGV[10], after a tie's keys) the tenant's calibration hash
-- ARGV[1] now ('' = server TIME)  ARGV[2] entry id  ARGV[3] prior_alpha  ARGV[4] prior_beta
-- ARGV[5] usage_decay  ARGV[6] decay_interval_s  ARGV[7] refresh TTL (1/0)
-- ARGV[8] the serving bar of the expected reward ('' = serve whatever the reward)
-- ARGV[9] the similarity this entry matched at ('' = unknown)
-- ARGV[10] the digest of the question asked ('' = not a speculative near match)
-- ARGV[11] the bar of the question's own entry under an error bound ('' = none), held to
-- when this entry is the question's own (the digest names it, or ARGV[12] says so)
-- ARGV[12] '1': this entry is the question's own, as the lookup knows without a digest
-- (its exact-match entry, served alone or ranked first); '' otherwise. Never a similarity
-- test: another question's entry may match at similarity 1 (an identical embedding).
-- ARGV[13] the lookup's position in the log, to peek from ('' = no peek)
-- ARGV[14] the most events the peek returns
-- ARGV[15] a near match's text guard ('' or absent: none): 8 characters, one per
-- combination of text differences (learning/text_match.py: 1 numbers, 2 names, 4
-- negation), '1' for those the bound lets serve, then the sketch of the question asked.
-- The entry is served only if its own question differs from it by a combination let
-- through; the question's own entry (the digest or ARGV[12]) is never guarded.
-- returns {1, state, doc, meta, the confidence before this use} served (the state as
-- written: 120 bytes, zc_pack_state); {0} gone; {-1} expired;
-- {-3} corrupt state, or a meta the lookup would refuse (zc_sound_meta: reported in `bad`
-- unless only of another schema version), or its hash lost while its state and id remain
-- (reported in `bad`); nothing counted;
-- {-4, expected reward at now} expected reward below the bar; {-5} similarity below the
-- entry's own learned bar; {-6} the question asked has an entry of its own, another one;
-- {-7} a tie it may not win; {-8, expected reward at now} the entry carries a dispute
-- (dispute.lua): held out until a verification (or a reaction) settles it, as a near
-- match to another question always, as the question's own entry under an error bound; {-9, the combination of text differences} its question differs from the one asked
-- in a way the guard (ARGV[15]) does not let through (nothing written, not served, for
-- -4 to -9).
-- With a digest (a lookup serving its best near match before it knows whether the
-- question is cached itself): if the digest names another entry, that one is the
-- lookup's to rank first, so this one is not served; if it names this one, it is served
-- as the question's own entry (similarity 1, and its own bar too). The reply is then
-- {the reply above, the id the digest names or false, the peek, the tenant's label
-- stamp}: the lookup reads neither the digest nor the log anywhere else. The stamp
-- (calibration field lv, bumped by every label and policy change) tells a replica its
-- policy is behind by that many labels. The peek is the log's events from the
-- newest back to the position (XREVRANGE, at most ARGV[14]), as the lookup's own
-- XREVRANGE would return them; 1 when no event is newer than the position (the replica
-- is current: the common case, sent back as one integer); false without a position.
-- Serving an entry: bring its arm to now, count the use, recompute confidence, bump the
-- version (eviction skips entries whose version moved since they were scored), and count
-- the LLM call it saved in the stats hash (saved:<model>:*, savings.py) when its put gave
-- the call's usage. The use count after this serve is the hit's number (CacheHit.hit_number).
--
-- A tie (only with ARGV[10]; ARGV[16] = '' or absent: none): the lookup's candidates
-- within similarity_tie_margin of this one, which the lookup's ranking would order by
-- their composite score (PolicyLearner.score_candidates). This entry is served only if
-- its lowest possible composite is above every rival's highest: an arm without evidence
-- scores its mean, one with evidence (or every arm, ARGV[18] = '1') anything its Thompson
-- draw in [0, 1] gives. Then the ranking would put it first whatever it drew. Otherwise
-- the reply is {-7}, the lookup ranks them itself, and nothing is written (but a state
-- of this entry's moved or recreated, as reading it does: zc_raw_state). The question's
-- own entry (the digest names this one) ranks first whatever the rivals are.
-- ARGV[16] similarity_bonus_scale  ARGV[17] the confidence weight  ARGV[18] draw every arm
-- ARGV[19] R rivals  ARGV[20] N ids  ARGV[21 .. 20+N] the lookup's candidates, this
-- entry first, then the R rivals, then the rest  ARGV[21+N .. 20+N+R] the rivals'
-- similarities  KEYS[7+i] the entry hash of the i-th candidate.
-- With a tie, a reply other than served carries at [3] the candidates' states as
-- read_states reads them: {the HMGET of meta/arm/use/sz of each hash, the HMGET of the
-- state hash, the ZMSCORE of the ids}, so that ranking them takes no read of its own.
local now = zc_now(ARGV[1])
local id = ARGV[2]
local prior_a, prior_b = tonumber(ARGV[3]), tonumber(ARGV[4])
local decay, interval = tonumber(ARGV[5]), tonumber(ARGV[6])
local tied = ARGV[16] and ARGV[16] ~= ''  -- a tie: rivals to outrank (ARGV[16..])
local asked = ARGV[10] and ARGV[10] ~= ''
-- The question's own entry, if it has one (read first: every reply carries it).
local own = asked and redis.call('HGET', KEYS[6], ARGV[10]) or nil
local own_bar = tonumber(ARGV[11] or '')

-- Whether this entry (its arm at now, matched at `similarity`) is sure to rank above the
-- rivals: false for a rival that may rank above it, or whose state cannot be read here.
local function first_of_tie(arm, use, similarity)
  local s, w, every = tonumber(ARGV[16]), tonumber(ARGV[17]), ARGV[18] == '1'
  local r, n = tonumber(ARGV[19]), tonumber(ARGV[20])
  local denom = 1.0 + s + w
  -- The composite's lowest and highest, as score_candidates computes it (same operations
  -- in the same order, so the same doubles).
  local function span(a, u, sim)
    local mean = a.a / (a.a + a.b)
    if every or a.n ~= 0 then
      return (sim + s * 0 + w * u.c) / denom, (sim + s * 1 + w * u.c) / denom
    end
    local c = (sim + s * mean + w * u.c) / denom
    return c, c
  end
  local lowest = span(arm, use, similarity)
  local ids = {}
  for i = 1, r do
    ids[i] = ARGV[21 + i]
  end
  local raws = redis.call('HMGET', KEYS[4], unpack(ids))
  for i = 1, r do
    local raw = raws[i]
    if not raw then
      -- no state: gone (then it does not compete), or a state to move or recreate
      if redis.call('EXISTS', KEYS[8 + i]) == 1 then
        return false
      end
    else
      local a, u = zc_state(raw)
      if not a then
        return false
      end
      zc_decay(a, now, prior_a, prior_b, decay, interval)
      local _, highest = span(a, u, tonumber(ARGV[20 + n + i]))
      if not (lowest > highest) then
        return false
      end
    end
  end
  return true
end

local function serve()
  local score = redis.call('ZSCORE', KEYS[2], id)
  local raw = redis.pcall('HMGET', KEYS[1], 'meta', 'doc', 'dsp')
  if raw.err then
    -- A key of another type (hand-made damage): never served, reported for eviction.
    redis.call('SADD', KEYS[5], id)
    return {-3}
  end
  local state = zc_raw_state(KEYS[4], KEYS[1], id, {a = prior_a, b = prior_b, now = now})
  if not score or not (state or raw[1] or raw[2]) then
    return {0}
  end
  if tonumber(score) <= now then
    return {-1}
  end
  local bar, similarity = tonumber(ARGV[8]), tonumber(ARGV[9])
  if own and own ~= id then
    return {-6}
  end
  -- The question's own entry: named by the digest, or by the lookup (ARGV[12]); held to
  -- its own bar under a bound.
  local mine = own or ARGV[12] == '1'
  local held = own_bar and mine
  if mine then
    similarity = 1
  end
  if held and (not bar or own_bar > bar) then
    bar = own_bar
  end
  local arm, use, size = zc_state(state)
  if not arm then
    return {-3}
  end
  if not (raw[1] or raw[2]) then
    -- The entry's hash is gone (an allkeys-* eviction, a DEL) while its id and state
    -- remain: the worker's scan reads states, not hashes, so this lookup reports it for
    -- eviction.
    redis.call('SADD', KEYS[5], id)
    return {-3}
  end
  zc_decay(arm, now, prior_a, prior_b, decay, interval)
  local reward = arm.a / (arm.a + arm.b)
  -- A dispute first: whatever its level, the next answer (or the user's reaction to the
  -- disputed one) decides. Held out of near matches to other questions; the question's
  -- own entry only under a bound.
  if raw[3] and (held or not mine) then
    return {-8, string.format('%.17g', reward)}
  end
  if bar and reward < bar then
    return {-4, string.format('%.17g', reward)}
  end
  if similarity and similarity < use.sb then
    return {-5}
  end
  local guard = ARGV[15]
  if guard and guard ~= '' and not mine then
    -- a near match the bound serves only for some text differences: its question's
    local doc = zc_unpack(raw[2])
    local text = doc and doc.q
    local index = type(text) == 'string' and zc_text_combo(string.sub(guard, 9), text) or 7
    if string.sub(guard, index + 1, index + 1) ~= '1' then
      return {-9, index}
    end
  end
  if tied and not mine and not first_of_tie(arm, use, similarity) then
    return {-7}
  end
  -- Its meta, decoded once, as the lookup will decode it (codec.unpack_meta): one that
  -- the lookup refuses is neither served nor counted, and is reported for eviction
  -- (unless it is only another version's).
  local meta, foreign = zc_sound_meta(raw[1])
  if not meta then
    if not foreign then
      redis.call('SADD', KEYS[5], id)
    end
    return {-3}
  end
  if ARGV[7] == '1' and meta.ttl > 0 then
    redis.call('ZADD', KEYS[2], 'XX', string.format('%.17g', now + meta.ttl), id)
  end
  use.n = use.n + 1
  if now > use.la then
    use.la = now
  end
  use.v = use.v + 1
  local ranked_c = use.c  -- the confidence a ranking of it would have used
  use.c = zc_confidence(arm, use)
  local packed = zc_pack_state(arm, use, size)
  redis.call('HSET', KEYS[4], id, packed)
  redis.call('HINCRBY', KEYS[3], 'hits', 1)
  -- The call the hit saved (an answer put with its usage), counted in the same step that
  -- serves it: a wrong hit (feedback.lua) is never counted before its saving.
  local model, prompt, completion = zc_usage(meta)
  if model then
    zc_count_usage(KEYS[3], 'saved', model, prompt, completion)
  end
  return {1, packed, raw[2], raw[1], string.format('%.17g', ranked_c)}
end

local res = serve()
if res[1] ~= 1 and tied then
  local n = tonumber(ARGV[20])
  local ids, rows = {}, {}
  for i = 1, n do
    ids[i] = ARGV[20 + i]
    rows[i] = redis.pcall('HMGET', KEYS[7 + i], 'meta', 'arm', 'use', 'sz')
    if rows[i].err then  -- a key of another type: read as an entry without its hash
      rows[i] = {false, false, false, false}
    end
  end
  res[2] = res[2] or false
  res[3] = {rows, redis.call('HMGET', KEYS[4], unpack(ids)),
            redis.call('ZMSCORE', KEYS[2], unpack(ids))}
end
if asked then
  local peek = false
  if ARGV[13] ~= '' then
    -- Anything newer than the position? (exclusive: a current replica's peek reads no
    -- event, where an inclusive range would turn the position's own into Lua tables.)
    -- None: 1, which the lookup reads as the empty range it is.
    if #redis.call('XREVRANGE', KEYS[7], '+', '(' .. ARGV[13], 'COUNT', 1) == 0 then
      peek = 1
    else
      peek = redis.call('XREVRANGE', KEYS[7], '+', ARGV[13], 'COUNT', ARGV[14])
    end
  end
  return {res, own or false, peek, redis.call('HGET', KEYS[#KEYS], 'lv') or 0}
end
return res
