-- epoch: this lifetime of the data, begun now ("<server seconds>.<micros>:<id>") when absent.
-- KEYS: epoch; ARGV: a random id
local v = redis.call('GET', KEYS[1])
if v then return v end
local t = redis.call('TIME')
v = t[1] .. '.' .. string.format('%06d', tonumber(t[2])) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], v)
return v
