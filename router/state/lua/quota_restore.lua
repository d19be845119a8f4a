-- include: now quota
-- quota_restore: a decision log's quota events into a new epoch. ARGV: prefix, record ttl ms, then
-- groups of 8: 'R', id, bucket names ('\n'-joined), tokens, usd, ms since it was admitted, its day,
-- ms of its hold left -- booked unless the id has a record -- or 'S', id, '', tokens ('' kept),
-- usd ('' kept), 0, 0, 0 (its settle). A record the new epoch holds -- reserved or settled there --
-- is never booked again. {booked, settled}
local ttl = tonumber(ARGV[2])
local booked, settled = 0, 0
for i = 3, #ARGV, 8 do
  local rid = ARGV[i + 1]
  local rec = base .. 'qr:' .. rid
  if ARGV[i] == 'R' then
    if redis.call('EXISTS', rec) == 0 then
      local left = tonumber(ARGV[i + 7])
      book(rec, rid, ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), now - tonumber(ARGV[i + 5]),
           ARGV[i + 6], now + left, math.max(left, 0) + ttl)
      booked = booked + 1
    end
  else
    settled = settled + settle(rec, rid, ARGV[i + 3], ARGV[i + 4])
  end
end
return {booked, settled}
