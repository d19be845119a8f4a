-- The guard of a request the new epoch cannot decide yet (router/state/redis.py, "A keyed request
-- after a loss", "A quota'd request after a loss"). Args: the epoch and restoring keys, the epoch
-- this router has restored into ('' none; '*' no guard), the restore window in ms. nil: decide;
-- 0: this router has not restored into the current epoch (or there is none: the data was lost);
-- 1: other routers may still be restoring theirs (the window, or a restore announced and not ended)
local function restoring(epoch_key, restoring_key, mine, window_ms)
  if mine == '*' then return nil end
  local e = redis.call('GET', epoch_key)
  if (not e) or e ~= mine then return 0 end
  local tm = redis.call('TIME')
  local at = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
  if at < tonumber(string.sub(e, 1, string.find(e, ':', 1, true) - 1)) * 1000 + tonumber(window_ms) then
    return 1
  end
  local r = redis.call('HGETALL', restoring_key)
  for i = 2, #r, 2 do
    local bar = string.find(r[i], '|', 1, true)
    if bar and string.sub(r[i], 1, bar - 1) == e and tonumber(string.sub(r[i], bar + 1)) > at then return 1 end
  end
  return nil
end
