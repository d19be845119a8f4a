-- include: now eject
-- eject_report: attempts' outcomes folded into their targets' ejection records, in order. KEYS: ej
-- (hash target -> record). ARGV: after, base ms, max ms, then pairs (target, failed 0/1).
-- 5 values a target (lib/eject.lua's ej_answer; the flag: this outcome ejected it)
local after, base_ms, max_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV, 2 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  local failed = ARGV[i + 1] == '1'
  local r = ej_read(v)
  local ejected = ej_step(r, failed, now, after, base_ms, max_ms)
  if v or failed then redis.call('HSET', KEYS[1], ARGV[i], ej_write(r)) end
  ej_answer(out, r, now, ejected)
end
return out
