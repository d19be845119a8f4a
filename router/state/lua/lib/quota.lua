-- Tenant quotas: router/state/ledger.py's arithmetic, step for step; times in ms of the server's
-- clock. ARGV[1] is the key prefix; per bucket b: <prefix>q:<b>:c (zset id -> hold's end), :w (zset
-- id -> admitted at), :wt (hash id -> tokens), :ws (the window's sum), :d (hash 'n:<day>',
-- 'usd:<day>'); per reservation <prefix>qr:<id> (hash k: its buckets, tok, usd, day, s: settled).
-- Every key holds the one hash tag of the prefix: one slot. Needs lib/now.lua.
local base = ARGV[1]
local WINDOW_MS = @WINDOW_MS@
local function f(x) return string.format('%.17g', x) end

-- drop what left a bucket: concurrency slots past their hold, tokens past the window
local function evict(b)
  redis.call('ZREMRANGEBYSCORE', base .. b .. ':c', '-inf', now)
  local w, wt = base .. b .. ':w', base .. b .. ':wt'
  while true do
    local old = redis.call('ZRANGEBYSCORE', w, '-inf', now - WINDOW_MS, 'LIMIT', 0, 256)
    if #old == 0 then break end
    local toks = redis.call('HMGET', wt, unpack(old))
    local s = 0
    for i = 1, #old do s = s + tonumber(toks[i] or '0') end
    redis.call('HDEL', wt, unpack(old))
    redis.call('ZREM', w, unpack(old))
    redis.call('INCRBY', base .. b .. ':ws', -s)
  end
end

-- a reservation's feedback: its slot freed, its tokens and USD become the reported ones ('' kept); once
local function settle(rec, rid, tokens, usd)
  local r = redis.call('HMGET', rec, 'k', 'tok', 'usd', 'day', 's')
  if (not r[1]) or r[5] then return 0 end
  for b in string.gmatch(r[1], '[^\n]+') do
    redis.call('ZREM', base .. b .. ':c', rid)
    if tokens ~= '' then
      local old = redis.call('HGET', base .. b .. ':wt', rid)
      if old then
        redis.call('HSET', base .. b .. ':wt', rid, tokens)
        redis.call('INCRBY', base .. b .. ':ws', tonumber(tokens) - tonumber(old))
      end
    end
    if usd ~= '' then
      local d = base .. b .. ':d'
      if redis.call('HEXISTS', d, 'usd:' .. r[4]) == 1 then
        redis.call('HINCRBYFLOAT', d, 'usd:' .. r[4], f(tonumber(usd) - tonumber(r[3])))
      end
    end
  end
  redis.call('HSET', rec, 's', '1')  -- settled: kept until its TTL, so a restore never books it again
  return 1
end

-- undo a reservation entirely (not admitted after all); 0 when none is held (or it is settled)
local function unbook(rec, rid)
  local r = redis.call('HMGET', rec, 'k', 'tok', 'usd', 'day', 's')
  if (not r[1]) or r[5] then return 0 end
  for b in string.gmatch(r[1], '[^\n]+') do
    redis.call('ZREM', base .. b .. ':c', rid)
    local old = redis.call('HGET', base .. b .. ':wt', rid)
    if old then
      redis.call('HDEL', base .. b .. ':wt', rid)
      redis.call('ZREM', base .. b .. ':w', rid)
      redis.call('INCRBY', base .. b .. ':ws', -tonumber(old))
    end
    local d = base .. b .. ':d'
    if redis.call('HEXISTS', d, 'n:' .. r[4]) == 1 then
      redis.call('HINCRBY', d, 'n:' .. r[4], -1)
      redis.call('HINCRBYFLOAT', d, 'usd:' .. r[4], f(-tonumber(r[3])))
    end
  end
  redis.call('DEL', rec)
  return 1
end

-- count a reservation in its buckets ('\n'-joined), its slot held until till, its record kept ttl ms
local function book(rec, rid, keys, tokens, usd, at, day, till, ttl)
  for b in string.gmatch(keys, '[^\n]+') do
    if till > now then redis.call('ZADD', base .. b .. ':c', till, rid) end
    if at > now - WINDOW_MS then
      redis.call('ZADD', base .. b .. ':w', at, rid)
      redis.call('HSET', base .. b .. ':wt', rid, tokens)
      redis.call('INCRBY', base .. b .. ':ws', tokens)
    end
    local d = base .. b .. ':d'
    redis.call('HINCRBYFLOAT', d, 'usd:' .. day, f(usd))
    if redis.call('HINCRBY', d, 'n:' .. day, 1) == 1 then  -- a new day: forget the day before yesterday
      redis.call('HDEL', d, 'n:' .. (day - 2), 'usd:' .. (day - 2))
      redis.call('PEXPIRE', d, 3 * 86400000)
    end
  end
  redis.call('HSET', rec, 'k', keys, 'tok', tokens, 'usd', f(usd), 'day', day)
  redis.call('PEXPIRE', rec, ttl)
end

-- The check of one request (tokens, usd, one request, one slot) against every limit of its buckets:
-- ARGV[i] the number of buckets, then per bucket, from ARGV[i + j]: name, max_concurrent,
-- tokens_per_minute, requests_per_day, usd_per_day (-1: none). nil and the buckets' names ('\n'-
-- joined) when all have room; else {0, bucket index, limit, its value, used, requested, retry ms
-- (-1: never)}: the first limit hit
local function quota_check(i, j, tokens, usd, day)
  local names = {}
  for k = 0, tonumber(ARGV[i]) - 1 do
    local a = i + j + 5 * k
    local b = ARGV[a]
    names[#names + 1] = b
    evict(b)
    local cc, tpm, rpd, ul = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
    if cc >= 0 then
      local n = redis.call('ZCARD', base .. b .. ':c')
      if n + 1 > cc then return {0, k, 'max_concurrent', f(cc), f(n), '1', '1000'} end
    end
    local d = base .. b .. ':d'
    local days = (rpd >= 0 or ul >= 0) and redis.call('HMGET', d, 'n:' .. day, 'usd:' .. day) or {}
    if tpm >= 0 then
      local s = tonumber(redis.call('GET', base .. b .. ':ws') or '0')
      if s + tokens > tpm then
        local retry = -1
        if tokens <= tpm then
          local excess, off = s + tokens - tpm, 0
          while retry < 0 do
            local page = redis.call('ZRANGE', base .. b .. ':w', off, off + 255, 'WITHSCORES')
            if #page == 0 then retry = 0 break end
            local ids = {}
            for m = 1, #page, 2 do ids[#ids + 1] = page[m] end
            local toks = redis.call('HMGET', base .. b .. ':wt', unpack(ids))
            for m = 1, #ids do
              excess = excess - tonumber(toks[m] or '0')
              if excess <= 0 then retry = tonumber(page[2 * m]) + WINDOW_MS - now break end
            end
            off = off + 256
          end
        end
        return {0, k, 'tokens_per_minute', f(tpm), f(s), f(tokens), f(retry)}
      end
    end
    if rpd >= 0 then
      local n = tonumber(days[1] or '0')
      if n + 1 > rpd then return {0, k, 'requests_per_day', f(rpd), f(n), '1', f((day + 1) * 86400000 - now)} end
    end
    if ul >= 0 then
      local u = tonumber(days[2] or '0')
      if u + usd > ul then return {0, k, 'usd_per_day', f(ul), f(u), f(usd), f((day + 1) * 86400000 - now)} end
    end
  end
  return nil, table.concat(names, '\n')
end

-- what a bucket holds now: concurrent, window tokens, requests today, USD today (appended to out)
local function usage(b, day, out)
  evict(b)
  local d = base .. b .. ':d'
  out[#out + 1] = redis.call('ZCARD', base .. b .. ':c')
  out[#out + 1] = redis.call('GET', base .. b .. ':ws') or '0'
  out[#out + 1] = redis.call('HGET', d, 'n:' .. day) or '0'
  out[#out + 1] = redis.call('HGET', d, 'usd:' .. day) or '0'
end
