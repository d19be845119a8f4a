-- include: now
-- restore: a decision log's reservations into a new epoch. KEYS: inflight, held, due; ARGV: groups
-- of 5 -- 'R', reservation id, pool, slots, hold ms left (a reservation, unless that id is held
-- already) or 'X', reservation id, '', 0, 0 (its release). {reserved, released}
local reserved, released = 0, 0
for i = 1, #ARGV, 5 do
  local rid = ARGV[i + 1]
  local v = redis.call('HGET', KEYS[2], rid)
  if ARGV[i] == 'R' then
    if not v then
      local slots = tonumber(ARGV[i + 3])
      redis.call('HINCRBY', KEYS[1], ARGV[i + 2], slots)
      redis.call('HSET', KEYS[2], rid, slots .. ':' .. ARGV[i + 2])
      redis.call('ZADD', KEYS[3], now + tonumber(ARGV[i + 4]), rid)
      reserved = reserved + 1
    end
  elseif v then
    local sep = string.find(v, ':', 1, true)
    redis.call('HINCRBY', KEYS[1], string.sub(v, sep + 1), -tonumber(string.sub(v, 1, sep - 1)))
    redis.call('HDEL', KEYS[2], rid)
    redis.call('ZREM', KEYS[3], rid)
    released = released + 1
  end
end
return {reserved, released}
