-- The reservations of the pools. KEYS: inflight (hash pool -> slots), held (hash reservation id ->
-- "slots:pool"), due (sorted set reservation id -> deadline ms), expired (hash pool -> count).
-- Needs lib/now.lua.

-- release every reservation past its hold (at most 1000 a call); how many
local function expire_due(at)
  local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', at, 'LIMIT', 0, 1000)
  for _, rid in ipairs(due) do
    local v = redis.call('HGET', KEYS[2], rid)
    if v then
      local sep = string.find(v, ':', 1, true)
      local pool = string.sub(v, sep + 1)
      redis.call('HINCRBY', KEYS[1], pool, -tonumber(string.sub(v, 1, sep - 1)))
      redis.call('HINCRBY', KEYS[4], pool, 1)
      redis.call('HDEL', KEYS[2], rid)
    end
    redis.call('ZREM', KEYS[3], rid)
  end
  return #due
end

-- the pool a reservation holds, or false
local function held_pool(rid)
  local v = redis.call('HGET', KEYS[2], rid)
  if not v then return false end
  return string.sub(v, string.find(v, ':', 1, true) + 1)
end

-- free a reservation; its pool, or false when it was not held
local function release_held(rid)
  local v = redis.call('HGET', KEYS[2], rid)
  if not v then return false end
  local sep = string.find(v, ':', 1, true)
  local pool = string.sub(v, sep + 1)
  redis.call('HINCRBY', KEYS[1], pool, -tonumber(string.sub(v, 1, sep - 1)))
  redis.call('HDEL', KEYS[2], rid)
  redis.call('ZREM', KEYS[3], rid)
  return pool
end
