-- KEYS[1] the entry hash of a question's own cached answer a fresh answer disagreed with
-- ARGV[1] the dispute (msgpack [the entry's level, the fresh answer, the disputed put's
-- own settings (a map), the dispute's nonce]): a reaction or verification settles it
-- only by its nonce (resolve.lua, put.lua), never another dispute recorded since
-- returns 1 recorded, 0 the entry is gone
-- A verification of an exact repeat whose fresh answer disagreed was counted as a wrong
-- label at the entry's level; but the fresh answer may be the wrong one (an LLM errs
-- too). The entry stays, with the dispute, held out (hit.lua) until its next
-- verification, whose answer breaks the tie (resolve.lua), or the user's reaction to the
-- fresh answer: never served as a near match to another question, and under an error
-- bound not as the question's own either (without one nothing would verify it). The
-- label is conservative until then. It goes with the entry (evict and invalidate delete
-- the whole hash).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'dsp', ARGV[1])
return 1
