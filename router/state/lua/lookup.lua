-- include: now
-- lookup: the pools expected to hold the leading blocks of a prompt now, and where its session
-- last went (lib/prefix.lua's index). KEYS: pfx:sent, pfx:cap, pfx:ret, the session's key, then the
-- prompt's block keys in order. ARGV: ttl ms, has session (0/1).
-- {{pool, leading blocks, retention, ...}, the session's entry or false}
local cutoff = now - tonumber(ARGV[1])
local run, sent, cap = {}, {}, {}
for i = 5, #KEYS do
  local k = i - 5
  local flat = redis.call('HGETALL', KEYS[i])
  local adv = false
  for j = 1, #flat, 2 do
    local pool = flat[j]
    if (run[pool] or 0) == k then
      local v = flat[j + 1]
      local sep = string.find(v, ':', 1, true)
      local tv = tonumber(string.sub(v, sep + 1))
      if tv <= now and tv >= cutoff then
        if sent[pool] == nil then
          sent[pool] = tonumber(redis.call('HGET', KEYS[1], pool) or '0')
          cap[pool] = tonumber(redis.call('HGET', KEYS[2], pool) or '0')
        end
        if sent[pool] - tonumber(string.sub(v, 1, sep - 1)) < cap[pool] then
          run[pool] = k + 1
          adv = true
        end
      end
    end
  end
  if not adv then break end
end
local out = {}
for pool, r in pairs(run) do
  out[#out + 1] = pool
  out[#out + 1] = r
  out[#out + 1] = redis.call('HGET', KEYS[3], pool) or '1'
end
local sess = false
if ARGV[2] == '1' then sess = redis.call('GET', KEYS[4]) end
return {out, sess}
