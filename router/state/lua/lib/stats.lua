-- A pool's outcome statistics (router/state/base.py's estimator): the hash key, alpha, ttft ms or '',
-- duration ms or '', failed 0/1
local function observe(key, a, ttft, dur, failed)
  local function ewm(name, x)
    local n = tonumber(redis.call('HGET', key, name .. '_n') or '0')
    local m, v = x, 0
    if n > 0 then
      m = tonumber(redis.call('HGET', key, name .. '_mean'))
      v = tonumber(redis.call('HGET', key, name .. '_var'))
      local d = x - m
      m = m + a * d
      v = (1 - a) * (v + a * d * d)
    end
    redis.call('HSET', key, name .. '_mean', string.format('%.17g', m), name .. '_var', string.format('%.17g', v))
    redis.call('HINCRBY', key, name .. '_n', 1)
  end
  local outcomes = tonumber(redis.call('HGET', key, 'outcomes') or '0')
  local fr = failed
  if outcomes > 0 then
    local r = tonumber(redis.call('HGET', key, 'failure_rate'))
    fr = r + a * (failed - r)
  end
  redis.call('HSET', key, 'failure_rate', string.format('%.17g', fr))
  redis.call('HINCRBY', key, 'outcomes', 1)
  redis.call('HINCRBY', key, 'failures', failed)
  if ttft ~= '' then ewm('ttft', tonumber(ttft)) end
  if dur ~= '' then ewm('dur', tonumber(dur)) end
end
