-- fairness: the admission queue's read of the tenants' fairness counters (never on the decision
-- path). KEYS: the counters' hash. ARGV[1] how many tenants to lift l, then l tenants (just
-- backlogged: each lifted to the lowest counter of the other tenants named, xroute.admission_rules.lift),
-- then the other backlogged tenants. {the counter of each tenant named, in ARGV order (strings)}
local l = tonumber(ARGV[1])
local low = nil
for i = 2 + l, #ARGV do
  local c = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if low == nil or c < low then low = c end
end
if low ~= nil then
  for i = 2, 1 + l do
    if tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') < low then
      redis.call('HSET', KEYS[1], ARGV[i], tostring(low))
    end
  end
end
local out = {}
for i = 2, #ARGV do out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i]) or '0' end
return out
