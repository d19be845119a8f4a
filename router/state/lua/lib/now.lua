-- now: the server's clock in ms (every script reads time here, never from a router)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
