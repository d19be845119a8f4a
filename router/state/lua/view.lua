-- include: now reserve quota
-- view: what the decisions and the status pages read. KEYS: inflight, held, due, expired. ARGV[1]
-- the key prefix, [2] durations too (0/1), then the quota buckets to read.
-- {inflight (flat hash), expired (flat hash), durations (flat: pool, mean ms of each pool with work
-- in flight that has one), quota usage (4 values a bucket: lib/quota.lua's usage)}
expire_due(now)
local inflight = redis.call('HGETALL', KEYS[1])
local durations = {}
if ARGV[2] == '1' then
  for i = 1, #inflight, 2 do
    if tonumber(inflight[i + 1]) > 0 then
      local d = redis.call('HMGET', base .. 'stats:' .. inflight[i], 'dur_mean', 'dur_n')
      if d[1] and d[2] and tonumber(d[2]) > 0 then
        durations[#durations + 1] = inflight[i]
        durations[#durations + 1] = d[1]
      end
    end
  end
end
local quotas = {}
local day = math.floor(now / 86400000)
for i = 3, #ARGV do usage(ARGV[i], day, quotas) end
return {inflight, redis.call('HGETALL', KEYS[4]), durations, quotas}
