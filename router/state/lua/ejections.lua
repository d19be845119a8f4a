-- include: now eject
-- ejections: every target ejected, half-open or with failures counted; the probe of each half-open
-- one the caller names whose lease is free becomes the caller's. KEYS: ej. ARGV: lease ms, then the
-- targets the caller may probe. 6 values a target: its name, then lib/eject.lua's ej_answer (the
-- flag: the caller holds its probe now)
local mine = {}
for i = 2, #ARGV do mine[ARGV[i]] = true end
local lease = tonumber(ARGV[1])
local flat = redis.call('HGETALL', KEYS[1])
local out = {}
for j = 1, #flat, 2 do
  local r = ej_read(flat[j + 1])
  if r[1] > 0 or r[4] > 0 then
    local took = false
    if r[4] > 0 and r[4] <= now and r[5] <= now and mine[flat[j]] then
      r[5] = now + lease
      redis.call('HSET', KEYS[1], flat[j], ej_write(r))
      took = true
    end
    out[#out + 1] = flat[j]
    ej_answer(out, r, now, took)
  end
end
return out
