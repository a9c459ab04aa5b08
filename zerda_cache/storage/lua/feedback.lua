-- KEYS[1] stats hash  KEYS[2] feedback stream  KEYS[3] evidence set (ids of arms with a
-- signal: the decay job's work list)  KEYS[4] state hash  KEYS[5..] entry hashes, one per
-- signal
-- ARGV[1] now ('' = server TIME)  ARGV[2] positive_feedback_reward
-- ARGV[3] negative_feedback_penalty  ARGV[4] prior_alpha  ARGV[5] prior_beta
-- ARGV[6] usage_decay  ARGV[7] decay_interval_s  ARGV[8] feedback log maxlen (approximate:
-- Redis trims whole stream nodes, so up to stream-node-max-entries (100) more may remain)
-- ARGV[9] similarity-bar margin  ARGV[10] share of the penalty a near-miss negative keeps
-- ARGV[11] negative-streak forget factor (1 = never forget)
-- then seven per signal: entry id, positive (1/0), magnitude, source, caller's timestamp,
-- the similarity the entry was served at ('' = unknown), the number of the served hit it
-- judges ('' = none: CacheHit.hit_number, the entry's use count after that serve)
-- returns one reply per signal: {1, arm, use} (msgpack) applied, and when the signal
-- counted its hit wrong in the savings, {1, arm, use, model, prompt, completion} (the
-- usage counted); {0} no such entry;
-- {-3} corrupt (its arm, use or meta missing or undecodable: zc_state, zc_sound_meta; as
-- when its hash was lost while its state remains: nothing written for it).
-- CachePolicyLearner.record_feedback, applied where the arm lives, for a batch of signals
-- of one tenant: one call amortises the script overhead over the batch.
--
-- A wrong hit (a negative signal naming its hit) counts the call the hit saved as bought
-- after all (wrong:<model>:*, savings.py), at most once per hit: the entry hash's `wh`
-- (a msgpack list) keeps the numbers of its hits counted wrong, and a number is counted
-- only if the entry was served that often (a hit that happened) and is one of its last
-- WRONG_WINDOW hits: older ones are refused and pruned from `wh`, which so stays small
-- (at most WRONG_WINDOW numbers: a few KB, outside `sz`). A state recreated at the
-- prior (zc_raw_state) starts its hit numbers over and drops `wh`. The count never passes
-- the tenant's saved calls of that model (which the hit script counts as it serves), so
-- the net saving is never below zero, even for an entry imported with its use count; a
-- hit the cap refuses is not marked, so that a later verdict on it still counts.
local now = zc_now(ARGV[1])
local pos_w, neg_w = tonumber(ARGV[2]), tonumber(ARGV[3])
local pa, pb = tonumber(ARGV[4]), tonumber(ARGV[5])
local decay, interval = tonumber(ARGV[6]), tonumber(ARGV[7])
local margin, near_share = tonumber(ARGV[9]), tonumber(ARGV[10])
local forget = tonumber(ARGV[11])
local prior = {a = pa, b = pb, now = now}
local out = {}
local n_pos, n_neg = 0, 0

-- How many of an entry's latest hits a wrong one may name (a feedback comes soon after
-- its hit): older hit numbers are not counted, nor kept in `wh`.
local WRONG_WINDOW = 1024

-- Count hit number `n` of the entry (hash `key`, with `meta`, served `served` times)
-- wrong, once: the usage counted, or nil.
local function count_wrong(key, meta, n, served)
  local model, prompt, completion = zc_usage(meta)
  local oldest = served - WRONG_WINDOW  -- the newest hit number out of the window
  if not model or n <= oldest or n < 1 or n > served or n ~= math.floor(n) then
    return nil
  end
  local marks = zc_unpack(redis.call('HGET', key, 'wh')) or {}
  local kept = {}
  for j = 1, #marks do
    local m = marks[j]
    if m == n then
      return nil
    end
    if type(m) == 'number' and m > oldest then
      kept[#kept + 1] = m
    end
  end
  local counts = redis.call('HMGET', KEYS[1], 'saved:' .. model .. ':calls',
                            'wrong:' .. model .. ':calls')
  if (tonumber(counts[2]) or 0) >= (tonumber(counts[1]) or 0) then
    return nil  -- not marked: counted once the saved calls allow it
  end
  kept[#kept + 1] = n
  redis.call('HSET', key, 'wh', cmsgpack.pack(kept))
  zc_count_usage(KEYS[1], 'wrong', model, prompt, completion)
  return {model, prompt, completion}
end

for i = 5, #KEYS do
  local base = 11 + (i - 5) * 7
  local state = zc_raw_state(KEYS[4], KEYS[i], ARGV[base + 1], prior)
  local meta = state and zc_sound_meta(redis.call('HGET', KEYS[i], 'meta'))
  if not state then
    out[#out + 1] = {0}
  else
    local arm, use, size = zc_state(state)
    if not arm or not meta then
      out[#out + 1] = {-3}
    else
      local positive = ARGV[base + 2] == '1'
      local wrong = nil
      local hit = tonumber(ARGV[base + 7])
      if not positive and hit then
        wrong = count_wrong(KEYS[i], meta, hit, use.n)
      end
      local magnitude = tonumber(ARGV[base + 3])
      local sim = tonumber(ARGV[base + 6])
      zc_decay(arm, now, pa, pb, decay, interval)
      -- An arm at its prior kept the time it was created or last decayed (it had nothing
      -- to decay): its evidence starts now, or this signal would count as already decayed
      -- since then (a day-old entry's first signal at a quarter of its weight).
      if now > arm.t then
        arm.t = now
      end
      if positive then
        local reward = magnitude * pos_w
        arm.a = arm.a + reward
        arm.r = arm.r + reward
        if sim and sim < use.pm then
          use.pm = sim
        end
        use.ns = nil  -- the run of complaints ends (absent reads as 0: a smaller map)
        n_pos = n_pos + 1
      else
        local reward = magnitude * neg_w
        -- CachePolicyLearner.record_feedback: a negative at a similarity below every
        -- positive's is blamed mostly on the match (the entry's own bar rises above it),
        -- only partly on the answer.
        if sim and sim < 1 - 1e-6 and sim < use.pm then
          local bar = math.min(sim + margin, 0.99999)  -- never above its own question
          if bar > use.sb then
            use.sb = bar
          end
          reward = reward * near_share
        else
          -- CachePolicyLearner.record_feedback: a complaint after a complaint forgets most
          -- of the praise the answer had (it may have gone stale).
          local streak = (use.ns or 0) + 1  -- zc_state checked it
          if streak >= 2 and arm.a > pa then
            arm.a = pa + (arm.a - pa) * forget
          end
          use.ns = streak
        end
        arm.b = arm.b + reward
        arm.r = arm.r - reward
        n_neg = n_neg + 1
      end
      arm.n = arm.n + 1
      use.v = use.v + 1
      use.c = zc_confidence(arm, use)
      local packed_arm, packed_use = cmsgpack.pack(arm), cmsgpack.pack(use)
      redis.call('SADD', KEYS[3], ARGV[base + 1])
      redis.call('HSET', KEYS[4], ARGV[base + 1], zc_pack_state(arm, use, size))
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'id', ARGV[base + 1],
                 'pos', ARGV[base + 2], 'mag', ARGV[base + 3], 'src', ARGV[base + 4],
                 'ts', ARGV[base + 5])
      if wrong then
        out[#out + 1] = {1, packed_arm, packed_use, wrong[1], wrong[2], wrong[3]}
      else
        out[#out + 1] = {1, packed_arm, packed_use}
      end
    end
  end
end
if n_pos > 0 then
  redis.call('HINCRBY', KEYS[1], 'positive', n_pos)
end
if n_neg > 0 then
  redis.call('HINCRBY', KEYS[1], 'negative', n_neg)
end
return out
