-- eject: outlier ejection's arithmetic (router.state.base.ejection_step, line for line). A record is
-- 'failures:streak:ejections:until ms:probe lease ms:back since ms' (until 0: not ejected).
local function ej_read(v)
  if not v then return {0, 0, 0, 0, 0, 0} end
  local r = {}
  for x in string.gmatch(v, '[^:]+') do r[#r + 1] = tonumber(x) end
  return r
end

local function ej_write(r)
  return r[1] .. ':' .. r[2] .. ':' .. r[3] .. ':' .. r[4] .. ':' .. r[5] .. ':' .. r[6]
end

-- one outcome folded into r (changed in place); true when it ejected the target
local function ej_step(r, failed, now, after, base_ms, max_ms)
  local fails, streak, total, untl, back = r[1], r[2], r[3], r[4], r[6]
  if untl > 0 then
    if now < untl then return false end
    if not failed then
      r[1], r[4], r[5], r[6] = 0, 0, 0, now
      return false
    end
  elseif not failed then
    r[1] = 0
    return false
  else
    fails = fails + 1
    if fails < after then
      r[1] = fails
      return false
    end
    if back > 0 and now - back >= max_ms then streak = 0 end
  end
  local interval = math.min(max_ms, base_ms * 2 ^ math.min(streak, 40))
  r[1], r[2], r[3], r[4], r[5] = 0, streak + 1, total + 1, now + interval, 0
  return true
end

-- the answer's part for one target: failures, ejections, ejected 0/1, ms left (until - now), flag
local function ej_answer(out, r, now, flag)
  out[#out + 1] = r[1]
  out[#out + 1] = r[3]
  out[#out + 1] = (r[4] > 0) and 1 or 0
  out[#out + 1] = (r[4] > 0) and (r[4] - now) or 0
  out[#out + 1] = flag and 1 or 0
end
