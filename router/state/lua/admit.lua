-- include: now reserve guard quota prefix
-- admit: one decision's pool, tenant quotas and prefix record, all or nothing, in one call.
-- KEYS: inflight, held, due, expired (lib/reserve.lua). ARGV[1] the key prefix, [2] reservation id,
-- [3] hold ms, [4] slots, [5] candidates c, then c x (pool, capacity) in rank order; at q = 6 + 2c
-- the quota part: 0, or 1 then tokens, usd, record ttl ms, buckets n, the epoch this router has
-- restored into and the restore window ms (lib/guard.lua), then n x (bucket, max_concurrent,
-- tokens_per_minute, requests_per_day, usd_per_day); after it the prefix part: 0, or 1 then what
-- lib/prefix.lua's record reads; the last two: the tenant whose fairness counter grows ('': none) and by
-- how much (admission on: xroute.admission_rules.service).
-- {1, pool}: admitted (a retry of a held id: its pool, nothing booked); {0}: no candidate has room;
-- {3, bucket index, limit, its value, used, requested, retry ms (-1: never)}: a quota refused;
-- {2, 0|1}: not decided, the quota counters are not whole yet (the guard's answer).
expire_due(now)
local rid = ARGV[2]
local held = held_pool(rid)
if held then return {1, held} end
local slots, c = tonumber(ARGV[4]), tonumber(ARGV[5])
local q = 6 + 2 * c
local p = q + 1
local rec = base .. 'qr:' .. rid
local charge = false
if ARGV[q] == '1' then
  p = q + 7 + 5 * tonumber(ARGV[q + 4])
  charge = redis.call('EXISTS', rec) == 0  -- (a record of this id: a retry, counted already)
  if charge then
    local g = restoring(base .. 'epoch', base .. 'restoring', ARGV[q + 5], ARGV[q + 6])
    if g then return {2, g} end
  end
end
local pool = nil
for i = 6, 5 + 2 * c, 2 do
  if tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') + slots <= tonumber(ARGV[i + 1]) then
    pool = ARGV[i]
    break
  end
end
if not pool then return {0} end
local hold = tonumber(ARGV[3])
if charge then
  local tokens, usd = tonumber(ARGV[q + 1]), tonumber(ARGV[q + 2])
  local day = math.floor(now / 86400000)
  local refused, names = quota_check(q + 4, 3, tokens, usd, day)
  if refused then
    refused[1] = 3
    return refused
  end
  book(rec, rid, names, tokens, usd, now, day, now + hold, hold + tonumber(ARGV[q + 3]))
end
redis.call('HINCRBY', KEYS[1], pool, slots)
redis.call('HSET', KEYS[2], rid, slots .. ':' .. pool)
redis.call('ZADD', KEYS[3], now + hold, rid)
if ARGV[p] == '1' then record(pool, rid, p + 1) end
if ARGV[#ARGV - 1] ~= '' then redis.call('HINCRBYFLOAT', base .. 'fair', ARGV[#ARGV - 1], ARGV[#ARGV]) end
return {1, pool}
