-- KEYS[1] the entry hash of a fresh answer that disagreed with the cached one it replaced
-- ARGV[1] the dispute (msgpack [level of the replaced entry, its answer])
-- returns 1 recorded, 0 the entry is gone
-- A verification of an exact repeat whose fresh answer disagreed was counted as a wrong
-- label at the replaced entry's level; but the fresh answer may be the wrong one (an LLM
-- errs too). The fresh entry keeps the dispute until its own next verification, whose
-- answer breaks the tie (resolve.lua): the label is conservative until then. It goes
-- with the entry (evict and invalidate delete the whole hash).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'dsp', ARGV[1])
return 1
