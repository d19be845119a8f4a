-- include: guard
-- claim: an idempotency key. KEYS: the key, epoch, restoring; ARGV: ttl ms, the epoch this router
-- has restored into, the restore window in ms. nil: claimed now; '': another request holds it; a
-- string: its answer; {0} / {1}: the guard's (a key the state holds is answered whatever the guard says)
local v = redis.call('GET', KEYS[1])
if v then return v end
local g = restoring(KEYS[2], KEYS[3], ARGV[2], ARGV[3])
if g then return {g} end
redis.call('SET', KEYS[1], '', 'PX', ARGV[1])
return false
