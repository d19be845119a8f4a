-- The prefix-affinity index (router/state/base.py; envs.prefix: the router's view), the same
-- arithmetic as the embedded state's: a block's hash key <prefix>pfx:b:<hash> holds, per pool that
-- recently received it, "stamp:ready ms" (the pool's count of blocks received before it, and when
-- the router expected it computed); pfx:sent counts each pool's blocks, pfx:cap its cache capacity
-- in blocks, pfx:ret its retention; pfx:pred:<decision> the pool and the cached tokens predicted.
-- Needs lib/now.lua and ARGV[1], the key prefix.
local pfx = ARGV[1]

-- Record a decision's blocks, session and prediction on the pool it took. From ARGV[i]: ttl ms, has
-- session (0/1), the session, entries per block, blocks m, the m block hashes (prompt order),
-- candidates k, then k x (pool, capacity in blocks, predicted tokens, ms until computed). Nothing
-- when the pool is not one of the candidates.
local function record(pool, rid, i)
  local ttl, entries, m = tonumber(ARGV[i]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
  local j = i + 5 + m
  local cap, pred, ready_in = nil, nil, nil
  for c = j + 1, j + 4 * tonumber(ARGV[j]), 4 do
    if ARGV[c] == pool then cap, pred, ready_in = ARGV[c + 1], ARGV[c + 2], tonumber(ARGV[c + 3]) end
  end
  if cap == nil then return false end
  local ready = now + ready_in
  local first = redis.call('HINCRBY', pfx .. 'pfx:sent', pool, m) - m
  redis.call('HSET', pfx .. 'pfx:cap', pool, cap)
  for n = 1, m do
    local key = pfx .. 'pfx:b:' .. ARGV[i + 4 + n]
    redis.call('HSET', key, pool, (first + m - n) .. ':' .. ready)
    if redis.call('HLEN', key) > entries then
      local flat = redis.call('HGETALL', key)
      local old, oldt = nil, nil
      for e = 1, #flat, 2 do
        local v = flat[e + 1]
        local tv = tonumber(string.sub(v, string.find(v, ':', 1, true) + 1))
        if oldt == nil or tv < oldt then old, oldt = flat[e], tv end
      end
      redis.call('HDEL', key, old)
    end
    redis.call('PEXPIRE', key, ttl + ready_in)
  end
  if ARGV[i + 1] == '1' then redis.call('SET', pfx .. 'sess:' .. ARGV[i + 2], pool, 'PX', ttl) end
  redis.call('SET', pfx .. 'pfx:pred:' .. rid, pool .. '|' .. pred, 'PX', ttl)
  return pool
end

-- A server reported cached tokens of the decision's prompt: the pool's retention learns it
-- (envs.prefix.retention_update), once per decision. The pool, or false (no prediction kept)
local function retention(rid, cached, alpha)
  local key = pfx .. 'pfx:pred:' .. rid
  local v = redis.call('GET', key)
  if not v then return false end
  redis.call('DEL', key)
  local pool, predicted = string.match(v, '^(.*)|([^|]*)$')
  predicted = tonumber(predicted)
  if predicted > 0 then
    local x = tonumber(cached) / predicted
    if x > 1 then x = 1 elseif x < 0 then x = 0 end
    local r = tonumber(redis.call('HGET', pfx .. 'pfx:ret', pool) or '1')
    r = r + tonumber(alpha) * (x - r)
    redis.call('HSET', pfx .. 'pfx:ret', pool, string.format('%.17g', r))
  end
  return pool
end
