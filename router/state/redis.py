"""The router's state in Redis or Valkey (``state_backend: redis``): every router process and host
pointed at one server shares one view.

Every operation that must be atomic across processes is one Lua script run server-side
(``EVALSHA``; a server that lacks a script, e.g. after a restart, gets it with ``SCRIPT LOAD`` and
the call again): check-and-reserve over the ranked candidates, release, the expiry of reservations
past their hold (run at the start of every reserve and read), the statistics' update, and the
idempotency claim, the epoch and the restore after a restart. Time inside the scripts is the server's (``TIME``), so routers whose clocks
disagree still expire reservations alike.

The script calls made during one event-loop iteration go to the server as one pipeline (redis-py's,
without a transaction: each script is atomic by itself), as the decision log groups its commits:
under load one round trip and one pass through the client's machinery serve every request of the
iteration (a reservation alone cost ~110 us of the router's CPU a request, most of it in the client).

Keys, all under ``<prefix>:{router}:`` (one hash tag, so a Redis Cluster keeps them in one slot,
as the multi-key scripts need): ``inflight`` (hash pool -> slots), ``held`` (hash reservation id ->
``slots:pool``), ``due`` (sorted set reservation id -> deadline in ms), ``expired`` (hash pool ->
count), ``stats:<pool>`` (hash of the estimator's fields), ``idem:<key>`` (string with a TTL; empty
while pending), ``epoch`` (this lifetime of the data: see below), ``restored:<epoch>:<log>`` (which
decision logs were restored into it); the prefix affinity index (``router.state.base``): ``pfx:b:<block
hash>`` (hash pool -> "stamp:ready ms", at most ``envs.prefix.VIEW_ENTRIES`` pools, expiring with
the age bound), ``pfx:sent`` / ``pfx:cap`` / ``pfx:ret`` (hashes per pool), ``pfx:pred:<decision>``
(the pool and the cached tokens predicted, until feedback or the age bound), ``sess:<session>``
(the pool its last request went to, or its committed migration's target, marked), ``restoring`` (the restores under way: below). Memory:
O(pools + reservations held + idempotency keys within their TTL).

A server that restarts without persistence (or is flushed) comes back empty: the ``epoch`` key is
gone. The routers notice within ``state_view_refresh_s`` (``router.app.factory``: each reads the epoch with
its shared view), one begins a new epoch (:meth:`RedisState.epoch`, recording the server's time), and
each decision log is replayed into it once (:meth:`RedisState.restore`, claimed per epoch and log):
the reservations of decisions made before the epoch began whose hold has not passed and whose
feedback has not come, and the idempotency keys still within their TTL. Decisions made after it
began were reserved in it live; a reservation already held is never booked twice.

A keyed request after a loss. Until the keys are back, a retry whose key the new epoch lacks would
be decided again -- a second placement for one Idempotency-Key, the case the key exists for (issue
21: 4 of 12 keys retried in the first half second). So the claim script refuses to claim a key the
state lacks -- answering ``{0}``/``{1}``, raised as :class:`router.state.base.StateRestoring`, the API's
503 ``state_restoring`` with ``Retry-After`` -- while (a) this router has not restored its log into
the current epoch (or there is none: the data is gone and nobody noticed yet), (b) the epoch is
younger than ``restore_window_s``, in which every live router notices it (each reads the epoch
every ``state_view_refresh_s``) and announces its restore, or (c) a restore announced for this
epoch has not ended (``restoring``: hash of ``<log>:<router>`` -> ``<epoch>|<deadline ms>``,
written before the log is read, removed after; the deadline, ``restore_lapse_s``, lets a router
that died restoring hold nobody back for long). A key the state holds is answered as ever (its
answer, or 409 while pending). The keys this process is deciding when a loss is noticed are put
back pending with the restore, so a retry elsewhere gets 409 until they are answered. What this
does not cover: a key answered by a router that is down while the data is lost (its log is
restored when it starts again: until then its keys within their TTL can be decided anew), or by
one that takes longer than the window to notice (an event loop stalled for a second).

A quota'd request after a loss. The same guard (``_GUARD``) holds back a tenant quota reservation
(``QUOTA_RESERVE`` answers ``{2, 0|1}``, raised as :class:`router.state.base.StateRestoring`): until every
log is back the counters are not whole, and a request admitted against them could exceed a limit.
A reservation's record (``qr:<id>``) outlives its settle, marked settled, for its record time, and
``QUOTA_RESTORE`` books no id that has one -- so a decision counted live in the new epoch is never
counted a second time by a restore, whatever the routers' clocks say about when it was made.

Unreachable or slow server (a connection refused, or no answer within ``timeout_s``): every
operation raises :class:`router.state.base.StateUnavailable` (the API's 503; or the embedded view with
``state_fail_open``). One reconnect is tried per call, so a restarted server is picked up at once.
The URL may hold a password (``redis://:secret@host``, from the environment, not a config file);
it is only ever shown through :func:`redact`.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from envs import prefix as px
from router.core.logs import LOG, iso
from router.core.settings import STATS_ALPHA
from router.state.base import (
    Affinity,
    Claim,
    Epoch,
    PoolStats,
    PrefixSend,
    Released,
    Reserved,
    RouterState,
    StateRestoring,
    StateUnavailable,
    _check_reserve,
    _finite,
)
from router.state.ledger import RECORD_S, QuotaReserved, QuotaSettled, QuotaUsage, QuotaVerdict
from xroute.schema.quota import WINDOW_S, QuotaBucket, day_index

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS: inflight, held, due, expired
_EXPIRE_DUE = """
local function expire_due(now)
  local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 1000)
  for _, rid in ipairs(due) do
    local v = redis.call('HGET', KEYS[2], rid)
    if v then
      local sep = string.find(v, ':', 1, true)
      local pool = string.sub(v, sep + 1)
      redis.call('HINCRBY', KEYS[1], pool, -tonumber(string.sub(v, 1, sep - 1)))
      redis.call('HINCRBY', KEYS[4], pool, 1)
      redis.call('HDEL', KEYS[2], rid)
    end
    redis.call('ZREM', KEYS[3], rid)
  end
  return #due
end
"""
# ARGV: reservation id, hold ms, slots, then pool, capacity pairs
RESERVE = _NOW + _EXPIRE_DUE + """
expire_due(now)
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held then
  return string.sub(held, string.find(held, ':', 1, true) + 1)
end
local slots = tonumber(ARGV[3])
for i = 4, #ARGV, 2 do
  local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if cur + slots <= tonumber(ARGV[i + 1]) then
    redis.call('HINCRBY', KEYS[1], ARGV[i], slots)
    redis.call('HSET', KEYS[2], ARGV[1], slots .. ':' .. ARGV[i])
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
    return ARGV[i]
  end
end
return false
"""
# ARGV: reservation id
RELEASE = """
local v = redis.call('HGET', KEYS[2], ARGV[1])
if not v then return false end
local sep = string.find(v, ':', 1, true)
local pool = string.sub(v, sep + 1)
redis.call('HINCRBY', KEYS[1], pool, -tonumber(string.sub(v, 1, sep - 1)))
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return pool
"""
# ARGV: which ('inflight' or 'expired'); returns the expired count and the hash
EXPIRE_AND_READ = _NOW + _EXPIRE_DUE + """
local n = expire_due(now)
local h = {}
if ARGV[1] == 'inflight' then h = redis.call('HGETALL', KEYS[1]) elseif ARGV[1] == 'expired' then
  h = redis.call('HGETALL', KEYS[4]) end
return {n, h}
"""
# KEYS: inflight, held, due, expired, stats; ARGV: pool
STATS = _NOW + _EXPIRE_DUE + """
expire_due(now)
return {redis.call('HGETALL', KEYS[5]), redis.call('HGET', KEYS[1], ARGV[1]), redis.call('HGET', KEYS[4], ARGV[1])}
"""
# KEYS: stats; ARGV: alpha, ttft ms or '', duration ms or '', failed 0/1 (the estimator of router.state.base)
OBSERVE = """
local a = tonumber(ARGV[1])
local function ewm(name, x)
  local n = tonumber(redis.call('HGET', KEYS[1], name .. '_n') or '0')
  local m, v = x, 0
  if n > 0 then
    m = tonumber(redis.call('HGET', KEYS[1], name .. '_mean'))
    v = tonumber(redis.call('HGET', KEYS[1], name .. '_var'))
    local d = x - m
    m = m + a * d
    v = (1 - a) * (v + a * d * d)
  end
  redis.call('HSET', KEYS[1], name .. '_mean', string.format('%.17g', m), name .. '_var', string.format('%.17g', v))
  redis.call('HINCRBY', KEYS[1], name .. '_n', 1)
end
local failed = tonumber(ARGV[4])
local outcomes = tonumber(redis.call('HGET', KEYS[1], 'outcomes') or '0')
local fr = failed
if outcomes > 0 then
  local r = tonumber(redis.call('HGET', KEYS[1], 'failure_rate'))
  fr = r + a * (failed - r)
end
redis.call('HSET', KEYS[1], 'failure_rate', string.format('%.17g', fr))
redis.call('HINCRBY', KEYS[1], 'outcomes', 1)
redis.call('HINCRBY', KEYS[1], 'failures', failed)
if ARGV[2] ~= '' then ewm('ttft', tonumber(ARGV[2])) end
if ARGV[3] ~= '' then ewm('dur', tonumber(ARGV[3])) end
return 1
"""
# KEYS: epoch; ARGV: a random id. The epoch, begun now ("<server seconds>.<micros>:<id>") when absent
EPOCH = """
local v = redis.call('GET', KEYS[1])
if v then return v end
local t = redis.call('TIME')
v = t[1] .. '.' .. string.format('%06d', tonumber(t[2])) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], v)
return v
"""
# KEYS: inflight, held, due; ARGV: groups of 5 -- 'R', reservation id, pool, slots, hold ms left
# (a reservation, unless that id is held already) or 'X', reservation id, '', 0, 0 (its release)
RESTORE = _NOW + """
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
"""
# The guard of a request the new epoch cannot decide yet (module docstring, "A keyed request after a
# loss", "A quota'd request after a loss"). Args:
# the epoch and restoring keys, the epoch this router has restored into ('' none; '*' no guard),
# the restore window in ms. nil: decide; 0: this router has not restored into the current epoch
# (or there is none: the data was lost); 1: other routers may still be restoring theirs (the
# window, or a restore announced and not ended)
_GUARD = """
local function restoring(epoch_key, restoring_key, mine, window_ms)
  if mine == '*' then return nil end
  local e = redis.call('GET', epoch_key)
  if (not e) or e ~= mine then return 0 end
  local t = redis.call('TIME')
  local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
"""
# KEYS: the key, epoch, restoring; ARGV: ttl ms, the epoch this router has restored into, the
# restore window in ms. nil: claimed now; '': another request holds it; a string: its answer;
# {0} / {1}: the guard's (a key the state holds is answered whatever the guard says)
CLAIM = _GUARD + """
local v = redis.call('GET', KEYS[1])
if v then return v end
local g = restoring(KEYS[2], KEYS[3], ARGV[2], ARGV[3])
if g then return {g} end
redis.call('SET', KEYS[1], '', 'PX', ARGV[1])
return false
"""
# KEYS: restoring; ARGV: field, epoch id, ms until the entry lapses (a router that died restoring)
BEGIN_RESTORE = _NOW + """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. (now + tonumber(ARGV[3])))
return 1
"""
ABANDON = """
if redis.call('GET', KEYS[1]) == '' then return redis.call('DEL', KEYS[1]) end
return 0
"""

# ---- tenant quotas (router.state.ledger's arithmetic, step for step; times in ms of the server's
# clock). ARGV[1] is the key prefix; per bucket b: <prefix>q:<b>:c (zset id -> hold's end),
# :w (zset id -> admitted at), :wt (hash id -> tokens), :ws (the window's sum), :d (hash 'n:<day>',
# 'usd:<day>'); per reservation <prefix>qr:<id> (hash k: its buckets, tok, usd, day, s: settled) -- KEYS[1]
# where one is named. Every key holds the one hash tag of the prefix: one slot.
_QUOTA = _NOW + """
local base = ARGV[1]
local WINDOW_MS = %(window_ms)d
local function f(x) return string.format('%%.17g', x) end
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
local function settle(rec, rid, tokens, usd)
  local r = redis.call('HMGET', rec, 'k', 'tok', 'usd', 'day', 's')
  if (not r[1]) or r[5] then return 0 end
  for b in string.gmatch(r[1], '[^\\n]+') do
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
local function book(rec, rid, keys, tokens, usd, at, day, till, ttl)
  for b in string.gmatch(keys, '[^\\n]+') do
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
"""
# KEYS: the reservation's record, epoch, restoring; ARGV: prefix, id, tokens, usd, hold ms, record ttl
# ms, buckets, the epoch this router has restored into and the restore window ms (_GUARD), then per
# bucket: name, max_concurrent, tokens_per_minute, requests_per_day, usd_per_day (-1: none).
# {1}: admitted; {0, bucket index, limit, its value, used, requested, retry ms (-1: never)};
# {2, 0 | 1}: not decided, the counters are not whole yet (the guard's answer)
QUOTA_RESERVE = _QUOTA + _GUARD + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {1} end
local g = restoring(KEYS[2], KEYS[3], ARGV[8], ARGV[9])
if g then return {2, g} end
local rid, tokens, usd = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local day = math.floor(now / 86400000)
local nb = tonumber(ARGV[7])
local names = {}
for i = 0, nb - 1 do
  local j = 10 + 5 * i
  local b = ARGV[j]
  names[#names + 1] = b
  evict(b)
  local cc, tpm, rpd, ul = tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
  if cc >= 0 then
    local n = redis.call('ZCARD', base .. b .. ':c')
    if n + 1 > cc then return {0, i, 'max_concurrent', f(cc), f(n), '1', '1000'} end
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
          for k = 1, #page, 2 do ids[#ids + 1] = page[k] end
          local toks = redis.call('HMGET', base .. b .. ':wt', unpack(ids))
          for k = 1, #ids do
            excess = excess - tonumber(toks[k] or '0')
            if excess <= 0 then retry = tonumber(page[2 * k]) + WINDOW_MS - now break end
          end
          off = off + 256
        end
      end
      return {0, i, 'tokens_per_minute', f(tpm), f(s), f(tokens), f(retry)}
    end
  end
  if rpd >= 0 then
    local n = tonumber(days[1] or '0')
    if n + 1 > rpd then return {0, i, 'requests_per_day', f(rpd), f(n), '1', f((day + 1) * 86400000 - now)} end
  end
  if ul >= 0 then
    local u = tonumber(days[2] or '0')
    if u + usd > ul then return {0, i, 'usd_per_day', f(ul), f(u), f(usd), f((day + 1) * 86400000 - now)} end
  end
end
local hold = tonumber(ARGV[5])
book(KEYS[1], rid, table.concat(names, '\\n'), tokens, usd, now, day, now + hold, hold + tonumber(ARGV[6]))
return {1}
"""
# KEYS: the record; ARGV: prefix, id, tokens or '' (as reserved), usd or ''
QUOTA_SETTLE = _QUOTA + """
return settle(KEYS[1], ARGV[2], ARGV[3], ARGV[4])
"""
# KEYS: the record; ARGV: prefix, id
QUOTA_RELEASE = _QUOTA + """
local r = redis.call('HMGET', KEYS[1], 'k', 'tok', 'usd', 'day', 's')
if (not r[1]) or r[5] then return 0 end
local rid = ARGV[2]
for b in string.gmatch(r[1], '[^\\n]+') do
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
redis.call('DEL', KEYS[1])
return 1
"""
# ARGV: prefix, bucket names. Per bucket: concurrent, window tokens, requests today, USD today
QUOTA_USAGE = _QUOTA + """
local day = math.floor(now / 86400000)
local out = {}
for i = 2, #ARGV do
  local b = ARGV[i]
  evict(b)
  local d = base .. b .. ':d'
  out[#out + 1] = redis.call('ZCARD', base .. b .. ':c')
  out[#out + 1] = redis.call('GET', base .. b .. ':ws') or '0'
  out[#out + 1] = redis.call('HGET', d, 'n:' .. day) or '0'
  out[#out + 1] = redis.call('HGET', d, 'usd:' .. day) or '0'
end
return out
"""
# ARGV: prefix, record ttl ms, then groups of 8: 'R', id, bucket names ('\n'-joined), tokens, usd,
# ms since it was admitted, its day, ms of its hold left -- booked unless the id is held already --
# or 'S', id, '', tokens ('' kept), usd ('' kept), 0, 0, 0 (its settle). A record the new epoch
# holds -- reserved or settled there -- is never booked again
QUOTA_RESTORE = _QUOTA + """
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
"""


# ---------------------------------------------------------------------------------- prefix affinity
# The index of router.state.base's docstring (envs.prefix: the router's view), the same arithmetic as
# EmbeddedState's: a block's hash key holds, per pool that recently received it, "stamp:ready ms"
# (the pool's count of blocks received before it, and when the router expected it computed);
# ``sent`` counts each pool's blocks, ``cap`` its cache capacity in blocks, ``ret`` its retention.
# KEYS: sent, cap, ret, session, then the prompt's block keys in order; ARGV: ttl ms, has session (0/1)
PREFIX_LOOKUP = _NOW + """
local cutoff = now - tonumber(ARGV[1])
local run, sent, cap = {}, {}, {}
for i = 5, #KEYS do
  local k = i - 5
  local flat = redis.call('HGETALL', KEYS[i])
  local adv = false
  for j = 1, #flat, 2 do
    local pool = flat[j]
    if (run[pool] or 0) == k then
      local v = flat[j + 1]
      local sep = string.find(v, ':', 1, true)
      local t = tonumber(string.sub(v, sep + 1))
      if t <= now and t >= cutoff then
        if sent[pool] == nil then
          sent[pool] = tonumber(redis.call('HGET', KEYS[1], pool) or '0')
          cap[pool] = tonumber(redis.call('HGET', KEYS[2], pool) or '0')
        end
        if sent[pool] - tonumber(string.sub(v, 1, sep - 1)) < cap[pool] then
          run[pool] = k + 1
          adv = true
        end
      end
    end
  end
  if not adv then break end
end
local out = {}
for pool, r in pairs(run) do
  out[#out + 1] = pool
  out[#out + 1] = r
  out[#out + 1] = redis.call('HGET', KEYS[3], pool) or '1'
end
local sess = false
if ARGV[2] == '1' then sess = redis.call('GET', KEYS[4]) end
return {out, sess}
"""
# KEYS: the session's key; ARGV: its entry, ttl ms. A script (not a plain SET) so that it goes in the
# iteration's pipeline: a burst of session writes (a migration storm's commits) takes one connection
SESSION_PUT = "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])"
# KEYS: held, sent, cap, session, prediction, then the block keys; ARGV: reservation id, ttl ms, has session,
# entries per block, then per candidate pool: pool, capacity, predicted tokens, ms until computed.
# Records on the pool the reservation took (nothing when it took none): run in the reservation's pipeline.
PREFIX_RECORD = _NOW + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return false end
local pool = string.sub(v, string.find(v, ':', 1, true) + 1)
local cap, pred, ready_in = nil, nil, nil
for i = 5, #ARGV, 4 do
  if ARGV[i] == pool then cap, pred, ready_in = ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]) end
end
if cap == nil then return false end
local ttl = tonumber(ARGV[2])
local entries = tonumber(ARGV[4])
local ready = now + ready_in
local n = #KEYS - 5
local base = redis.call('HINCRBY', KEYS[2], pool, n) - n
redis.call('HSET', KEYS[3], pool, cap)
for i = 1, n do
  local key = KEYS[5 + i]
  redis.call('HSET', key, pool, (base + n - i) .. ':' .. ready)
  if redis.call('HLEN', key) > entries then
    local flat = redis.call('HGETALL', key)
    local old, oldt = nil, nil
    for j = 1, #flat, 2 do
      local e = flat[j + 1]
      local t = tonumber(string.sub(e, string.find(e, ':', 1, true) + 1))
      if oldt == nil or t < oldt then old, oldt = flat[j], t end
    end
    redis.call('HDEL', key, old)
  end
  redis.call('PEXPIRE', key, ttl + ready_in)
end
if ARGV[3] == '1' then redis.call('SET', KEYS[4], pool, 'PX', ttl) end
redis.call('SET', KEYS[5], pool .. '|' .. pred, 'PX', ttl)
return pool
"""
# KEYS: prediction, ret; ARGV: cached tokens, alpha (envs.prefix.retention_update)
PREFIX_FEEDBACK = """
local v = redis.call('GET', KEYS[1])
if not v then return false end
redis.call('DEL', KEYS[1])
local pool, predicted = string.match(v, '^(.*)|([^|]*)$')
predicted = tonumber(predicted)
if predicted > 0 then
  local x = tonumber(ARGV[1]) / predicted
  if x > 1 then x = 1 elseif x < 0 then x = 0 end
  local r = tonumber(redis.call('HGET', KEYS[2], pool) or '1')
  r = r + tonumber(ARGV[2]) * (x - r)
  redis.call('HSET', KEYS[2], pool, string.format('%.17g', r))
end
return pool
"""


def redact(url: str) -> str:
    """``url`` as it may be shown or logged: scheme, host, port and database, never a password."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "redis://(unparsable URL)"
    return f"{u.scheme}://{host}{port}{u.path}"


def _f(x: bytes | None) -> float | None:
    return None if x is None else float(x)


class RedisState(RouterState):
    """The shared state on one Redis/Valkey server (module docstring)."""

    backend = "redis"

    def __init__(self, url: str, prefix: str = "xroute", timeout_s: float = 0.5, alpha: float = STATS_ALPHA,
                 max_connections: int = 64, record_ttl_s: float = RECORD_S, quota_window_s: float = WINDOW_S,
                 restore_window_s: float | None = None, restore_lapse_s: float = 120.0):
        """``restore_window_s``: guard the idempotency keys across a loss of the server's data (module
        docstring, "A keyed request after a loss"), as the app does (``state_restore_window_s``);
        None, for a process that restores no decision log into the state (a benchmark, a test of
        the operations): no guard."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.where = redact(url)
        self.alpha = alpha
        self.timeout_s = timeout_s
        self._r = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=max_connections,
            retry=Retry(NoBackoff(), 1), client_name="xroute-router")
        base = f"{prefix}:{{router}}:"
        self.base = base
        self._keys = [base + "inflight", base + "held", base + "due", base + "expired"]
        self._reserve = self._r.register_script(RESERVE)
        self._release = self._r.register_script(RELEASE)
        self._read = self._r.register_script(EXPIRE_AND_READ)
        self._observe = self._r.register_script(OBSERVE)
        self._stats = self._r.register_script(STATS)
        self._claim = self._r.register_script(CLAIM)
        self._abandon = self._r.register_script(ABANDON)
        self._epoch = self._r.register_script(EPOCH)
        self._restore = self._r.register_script(RESTORE)
        # (the tokens_per_minute window is 60 s; tests shorten it to watch it slide)
        win = {"window_ms": max(1, round(quota_window_s * 1000))}
        self._q_reserve = self._r.register_script(QUOTA_RESERVE % win)
        self._q_settle = self._r.register_script(QUOTA_SETTLE % win)
        self._q_release = self._r.register_script(QUOTA_RELEASE % win)
        self._q_usage = self._r.register_script(QUOTA_USAGE % win)
        self._q_restore = self._r.register_script(QUOTA_RESTORE % win)
        self.record_ttl_ms = max(1, math.ceil(record_ttl_s * 1000))
        self._begin_restore = self._r.register_script(BEGIN_RESTORE)
        #: idempotency (module docstring, "A keyed request after a loss"): the epoch this router
        #: has restored its log into ('*': no guard), the window after an epoch begins, how long an announced restore holds the others back at most, this
        #: process's name in the ``restoring`` hash, and the keys it has claimed and not yet
        #: completed or abandoned (claimed again, pending, in a new epoch)
        self._restored_epoch = "*" if restore_window_s is None else ""
        self.restore_window_s = restore_window_s or 0.0
        self.restore_lapse_s = restore_lapse_s
        self._instance = secrets.token_hex(6)
        self._claimed: dict[str, float] = {}
        self._pfx_lookup = self._r.register_script(PREFIX_LOOKUP)
        self._pfx_record = self._r.register_script(PREFIX_RECORD)
        self._pfx_feedback = self._r.register_script(PREFIX_FEEDBACK)
        self._sess_put = self._r.register_script(SESSION_PUT)
        self._pfx_keys = [base + "pfx:sent", base + "pfx:cap", base + "pfx:ret"]
        #: the script calls of the current event-loop iteration, and the pipelines in flight
        self._batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]] = []
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()

    def _down(self, e: BaseException) -> StateUnavailable:
        self.error = f"shared state {self.where}: {type(e).__name__}: {' '.join(str(e).split())}"[:300]
        return StateUnavailable(self.error)

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """One script call, sent with the others of this event-loop iteration (module docstring)."""
        return await self._submit(script, keys, args)

    def _submit(self, script: Any, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """Queue one script call with this event-loop iteration's; its future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._batch.append((script, keys, args, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)  # after every request of this iteration has queued its call
        return fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._batch = self._batch, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]) -> None:
        """The batch as one pipeline (one round trip; no transaction: each script is atomic on its
        own). A script the server lacks (restarted) is loaded and its calls sent again."""
        try:
            results = await self._pipeline(batch)
            self.error = None
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                    await self._r.script_load(script.script)
                again = await self._pipeline([batch[i] for i in missing])
                for i, r in zip(missing, again):
                    results[i] = r
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            results = [self._down(e)] * len(batch)
        except Exception as e:  # anything else: never leave a request waiting
            results = [e] * len(batch)
        for (script, keys, args, fut), r in zip(batch, results):
            if fut.done():  # the request went away meanwhile: what it took is given back --
                if script is self._reserve and isinstance(r, bytes):  # a reservation made for it,
                    self._undo(self._release, self._keys, [args[0]])
                elif script is self._claim and r is None:  # an idempotency key it claimed (else 409s for the TTL)
                    self._undo(self._abandon, keys, [])
                elif script is self._q_reserve and isinstance(r, list) and r and r[0] == 1:  # its quota
                    self._undo(self._q_release, keys, args[:2])
            elif isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    def _undo(self, script: Any, keys: list[str], args: list[Any]) -> None:
        """Queue ``script`` with the next pipeline, its answer awaited by nobody."""
        freed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        freed.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._batch.append((script, keys, args, freed))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _pipeline(self, batch: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]) -> list[Any]:
        async with self._r.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return await pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

    def _reserve_args(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                      slots: int = 1) -> list[Any]:
        _check_reserve(candidates, hold_s, slots)
        args: list[Any] = [reservation_id, max(1, math.ceil(hold_s * 1000)), slots]
        for pool, capacity in candidates:
            args += (pool, int(capacity))
        return args

    async def reserve(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                      slots: int = 1) -> str | None:
        got = await self._run(self._reserve, self._keys, self._reserve_args(candidates, reservation_id, hold_s, slots))
        return None if got is None else got.decode()  # type: ignore[no-any-return]

    async def reserve_with_quota(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                                 buckets: Sequence[QuotaBucket], tokens: int, usd: float
                                 ) -> tuple[str | BaseException | None, QuotaVerdict | BaseException]:
        """Both scripts queued in this event-loop iteration -- one pipeline, one round trip --
        without a task per call. A caller cancelled meanwhile cancels both futures, so what they
        reserve is given back when the answers arrive (``_send``)."""
        pool_f = self._submit(self._reserve, self._keys, self._reserve_args(candidates, reservation_id, hold_s))
        quota_f = self._submit(self._q_reserve, self._quota_keys(reservation_id),
                               self._quota_args(reservation_id, buckets, tokens, usd, hold_s))
        out: list[Any] = []
        try:
            for fut, parse in ((pool_f, lambda g: None if g is None else g.decode()), (quota_f, self._verdict)):
                try:
                    out.append(parse(await fut))
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    out.append(e)
        except asyncio.CancelledError:
            pool_f.cancel()
            quota_f.cancel()
            raise
        return out[0], out[1]

    async def release(self, reservation_id: str) -> str | None:
        got = await self._run(self._release, self._keys, [reservation_id])
        return None if got is None else got.decode()  # type: ignore[no-any-return]

    async def _hash(self, which: str) -> tuple[int, dict[str, int]]:
        n, flat = await self._run(self._read, self._keys, [which])
        return int(n), {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def in_flight(self) -> dict[str, int]:
        return {p: n for p, n in (await self._hash("inflight"))[1].items() if n}

    async def expire(self) -> int:
        return (await self._hash(""))[0]

    async def expired(self) -> dict[str, int]:
        return (await self._hash("expired"))[1]

    async def observe(self, pool: str, ttft_ms: float | None = None, duration_ms: float | None = None,
                      failed: bool = False) -> None:
        _finite(ttft_ms, "ttft_ms")
        _finite(duration_ms, "duration_ms")
        await self._run(self._observe, [self.base + "stats:" + pool],
                        [repr(self.alpha), "" if ttft_ms is None else repr(float(ttft_ms)),
                         "" if duration_ms is None else repr(float(duration_ms)), 1 if failed else 0])

    async def stats(self, pool: str) -> PoolStats:
        flat, in_flight, expired = await self._run(self._stats, [*self._keys, self.base + "stats:" + pool], [pool])
        h = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        outcomes = int(h.get(b"outcomes", 0))
        ttft_n, dur_n = int(h.get(b"ttft_n", 0)), int(h.get(b"dur_n", 0))
        var_t, var_d = _f(h.get(b"ttft_var")), _f(h.get(b"dur_var"))
        return PoolStats(pool, outcomes, int(h.get(b"failures", 0)),
                         _f(h.get(b"failure_rate")) if outcomes else None,
                         _f(h.get(b"ttft_mean")) if ttft_n else None,
                         math.sqrt(max(var_t, 0.0)) if ttft_n and var_t is not None else None,
                         _f(h.get(b"dur_mean")) if dur_n else None,
                         math.sqrt(max(var_d, 0.0)) if dur_n and var_d is not None else None,
                         int(in_flight or 0), int(expired or 0))

    async def durations(self, pools: Sequence[str]) -> dict[str, float]:
        if not pools:
            return {}
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for pool in pools:
                    pipe.hmget(self.base + "stats:" + pool, "dur_mean", "dur_n")
                got = await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None
        return {pool: float(mean) for pool, (mean, n) in zip(pools, got) if mean is not None and n and int(n) > 0}

    async def claim(self, key: str, ttl_s: float) -> Claim:
        got = await self._run(self._claim, [self.base + "idem:" + key, self.base + "epoch", self.base + "restoring"],
                              [max(1, math.ceil(ttl_s * 1000)), self._restored_epoch,
                               max(0, math.ceil(self.restore_window_s * 1000))])
        if got is None:
            now = time.monotonic()
            if len(self._claimed) > 4096:  # (each is dropped by complete or abandon; this only bounds a leak)
                self._claimed = {k: u for k, u in self._claimed.items() if u > now}
            self._claimed[key] = now + ttl_s
            return Claim("new")
        if isinstance(got, list):  # ({0}: this router's own restore is still to come; {1}: others')
            raise StateRestoring(
                f"shared state {self.where}: it lost its data and is being restored from the routers' decision "
                "logs; an Idempotency-Key it does not hold yet may have been answered before, so the request is not "
                "decided anew until every log is back")
        return Claim("pending") if got == b"" else Claim("done", bytes(got))

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        if not answer:
            raise ValueError("an idempotent answer must not be empty")
        self._claimed.pop(key, None)
        try:
            await self._r.set(self.base + "idem:" + key, bytes(answer), px=max(1, math.ceil(ttl_s * 1000)))
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None

    async def abandon(self, key: str) -> None:
        self._claimed.pop(key, None)
        await self._run(self._abandon, [self.base + "idem:" + key], [])

    # -------------------------------------------------------------- tenant quotas (router.state.ledger)
    async def quota_reserve(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                            hold_s: float) -> QuotaVerdict:
        got = await self._run(self._q_reserve, self._quota_keys(reservation_id),
                              self._quota_args(reservation_id, buckets, tokens, usd, hold_s))
        return self._verdict(got)

    def _quota_keys(self, reservation_id: str) -> list[str]:
        return [self.base + "qr:" + reservation_id, self.base + "epoch", self.base + "restoring"]

    def _quota_args(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                    hold_s: float) -> list[Any]:
        if not (hold_s > 0 and math.isfinite(hold_s)):
            raise ValueError(f"hold_s must be a positive number of seconds, got {hold_s!r}")
        args: list[Any] = [self.base, reservation_id, int(tokens), repr(float(usd)), max(1, math.ceil(hold_s * 1000)),
                           self.record_ttl_ms, len(buckets), self._restored_epoch,
                           max(0, math.ceil(self.restore_window_s * 1000))]
        for b in buckets:
            args += [b.key, *b.limits]
        return args

    def _verdict(self, got: Any) -> QuotaVerdict:
        if int(got[0]) == 1:
            return QuotaVerdict(True)
        if int(got[0]) == 2:
            raise StateRestoring(
                f"shared state {self.where}: it lost its data and is being restored from the routers' decision "
                "logs; a request that counts against a tenant quota is not admitted until every log is back, so the "
                "counters are whole")
        retry = float(got[6])
        return QuotaVerdict(False, int(got[1]), got[2].decode(), float(got[3]), float(got[4]), float(got[5]),
                            math.inf if retry < 0 else retry / 1000.0)

    async def quota_settle(self, reservation_id: str, tokens: int | None, usd: float | None) -> bool:
        got = await self._run(self._q_settle, [self.base + "qr:" + reservation_id],
                              [self.base, reservation_id, "" if tokens is None else int(tokens),
                               "" if usd is None else repr(float(usd))])
        return bool(got)

    async def quota_release(self, reservation_id: str) -> bool:
        return bool(await self._run(self._q_release, [self.base + "qr:" + reservation_id], [self.base, reservation_id]))

    async def quota_usage(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        if not keys:
            return {}
        flat = await self._run(self._q_usage, [], [self.base, *keys])
        return {k: QuotaUsage(int(flat[4 * i]), int(float(flat[4 * i + 1])), int(float(flat[4 * i + 2])),
                              float(flat[4 * i + 3])) for i, k in enumerate(keys)}

    async def _quota_restore(self, events: list[QuotaReserved | QuotaSettled], now_wall: float) -> dict[str, int]:
        """The quota events of a decision log, booked (``QUOTA_RESTORE``; limits are not checked)."""
        args: list[Any] = []
        for ev in events:
            if isinstance(ev, QuotaReserved):
                if ev.keys:
                    args += ["R", ev.reservation_id, "\n".join(ev.keys), int(ev.tokens), repr(float(ev.usd)),
                             max(0, int((now_wall - ev.at) * 1000)), day_index(ev.at),
                             int((ev.until - now_wall) * 1000)]
            else:
                args += ["S", ev.reservation_id, "", int(ev.tokens), repr(float(ev.usd)), 0, 0, 0]
        out = {"quota_reserved": 0, "quota_settled": 0}
        for i in range(0, len(args), 800):  # 100 events a script call, in order
            booked, settled = await self._run(self._q_restore, [], [self.base, self.record_ttl_ms, *args[i:i + 800]])
            out["quota_reserved"] += int(booked)
            out["quota_settled"] += int(settled)
        return out

    async def epoch(self) -> Epoch:
        got = (await self._run(self._epoch, [self.base + "epoch"], [secrets.token_hex(8)])).decode()
        return Epoch(got, float(got.partition(":")[0]))

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        await self._run(self._begin_restore, [self.base + "restoring"],
                        [f"{log_id}:{self._instance}", epoch.id, max(1, math.ceil(self.restore_lapse_s * 1000))])

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        try:
            await self._r.hdel(self.base + "restoring", f"{log_id}:{self._instance}")
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None
        if restored and self._restored_epoch != "*":
            self._restored_epoch = epoch.id

    async def restore(self, epoch: Epoch, log_id: str,
                      events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                      answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None
                      ) -> dict[str, int] | None:
        now_wall = time.time() if now_wall is None else now_wall
        done = f"{self.base}restored:{epoch.id}:{log_id}"
        try:
            # the keys this process is deciding now: pending in the new epoch too (a retry elsewhere gets 409)
            now_mono = time.monotonic()
            pending = [(k, until) for k, until in list(self._claimed.items()) if until > now_mono]
            if pending:
                async with self._r.pipeline(transaction=False) as pipe:
                    for key, until in pending:
                        pipe.set(self.base + "idem:" + key, b"", px=max(1, math.ceil((until - now_mono) * 1000)),
                                 nx=True)
                    await pipe.execute()
            if not await self._r.set(done, iso(time.time()), nx=True, ex=7 * 86400):
                return None
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None
        out = {"reserved": 0, "released": 0, "idempotency_keys": 0}
        try:
            args: list[Any] = []
            quota: list[QuotaReserved | QuotaSettled] = []
            for ev in events:
                if isinstance(ev, (QuotaReserved, QuotaSettled)):
                    quota.append(ev)
                elif isinstance(ev, Reserved) and ev.until > now_wall:
                    args += ["R", ev.reservation_id, ev.pool, ev.slots, max(1, math.ceil((ev.until - now_wall) * 1000))]
                elif isinstance(ev, Released):
                    args += ["X", ev.reservation_id, "", 0, 0]
            for i in range(0, len(args), 1000):  # 200 events a script call, in order
                r, x = await self._run(self._restore, self._keys[:3], args[i:i + 1000])
                out["reserved"] += int(r)
                out["released"] += int(x)
            if quota:
                out.update(await self._quota_restore(quota, now_wall))
            async with self._r.pipeline(transaction=False) as pipe:
                for key, answer, until in answers:
                    if until > now_wall and answer:
                        pipe.set(self.base + "idem:" + key, bytes(answer), px=max(1, math.ceil((until - now_wall) * 1000)),
                                 nx=True)
                got = await pipe.execute()
            out["idempotency_keys"] = sum(1 for g in got if g)
        except BaseException as e:  # let the next try do it all again (it books nothing twice)
            try:
                await self._r.delete(done)
            except (RedisError, OSError):
                pass
            if isinstance(e, (RedisConnectionError, RedisTimeoutError, OSError)):
                raise self._down(e) from None
            raise
        return out

    # -------------------------------------------------------------- prefix affinity and sessions
    def _block_keys(self, hashes: np.ndarray) -> list[str]:
        b = self.base + "pfx:b:"
        return [b + str(h) for h in hashes.tolist()]

    async def prefix_lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        keys = [*self._pfx_keys, self.base + "sess:" + (session or ""), *self._block_keys(hashes)]
        flat, sess = await self._run(self._pfx_lookup, keys, [max(1, math.ceil(ttl_s * 1000)),
                                                              0 if session is None else 1])
        runs, ret = {}, {}
        for i in range(0, len(flat), 3):
            pool = flat[i].decode()
            runs[pool] = int(flat[i + 1])
            ret[pool] = float(flat[i + 2])
        return Affinity(runs, ret, None if not sess else sess.decode())

    def _record_args(self, reservation_id: str, send: PrefixSend) -> tuple[list[str], list[Any]]:
        keys = [self._keys[1], self._pfx_keys[0], self._pfx_keys[1], self.base + "sess:" + (send.session or ""),
                self.base + "pfx:pred:" + reservation_id, *self._block_keys(send.hashes)]
        args: list[Any] = [reservation_id, max(1, math.ceil(send.ttl_s * 1000)), 0 if send.session is None else 1,
                           px.VIEW_ENTRIES]
        for pool, (cap, predicted, ready_in) in send.candidates.items():
            args += (pool, int(cap), repr(float(predicted)), max(0, math.ceil(ready_in * 1000)))
        return keys, args

    async def prefix_record(self, decision_id: str, pool: str, send: PrefixSend) -> None:
        if pool in send.candidates:  # the script records on the pool the reservation holds
            await self._run(self._pfx_record, *self._record_args(decision_id, send))

    async def reserve_recording(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                                send: PrefixSend, slots: int = 1) -> str | None:
        """:meth:`reserve` and the record of the prefix on the pool it takes, queued together: the
        two scripts go out in the same pipeline (one round trip; the record reads the reservation)."""
        reserving = asyncio.ensure_future(self.reserve(candidates, reservation_id, hold_s, slots))
        recording = asyncio.ensure_future(self._run(self._pfx_record, *self._record_args(reservation_id, send)))
        try:
            pool = await reserving
        except BaseException:
            await asyncio.gather(recording, return_exceptions=True)
            raise
        try:
            await recording
        except Exception as e:  # the affinity is a hint: a failed record costs no decision
            LOG.warning("prefix affinity not recorded", extra={"fields": {"error": str(e)}})
        return pool

    async def prefix_feedback(self, decision_id: str, cached_tokens: float, alpha: float) -> str | None:
        got = await self._run(self._pfx_feedback, [self.base + "pfx:pred:" + decision_id, self._pfx_keys[2]],
                              [repr(float(cached_tokens)), repr(float(alpha))])
        return None if got is None else got.decode()  # type: ignore[no-any-return]

    async def get_session(self, session_id: str) -> bytes | None:
        try:
            got = await self._r.get(self.base + "sess:" + session_id)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise self._down(e) from None
        return None if got is None else got if isinstance(got, bytes) else str(got).encode()

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        await self._run(self._sess_put, [self.base + "sess:" + session_id], [bytes(value), max(1, math.ceil(ttl_s * 1000))])

    async def healthy(self) -> bool:
        """A ``PING`` within ``timeout_s`` (the readiness probe; its verdict goes into ``error``)."""
        try:
            ok = bool(await self._r.ping())
        except (RedisError, OSError) as e:
            self._down(e)
            return False
        if ok:
            self.error = None
        return ok

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "url": self.where, "prefix": self.base, "timeout_s": self.timeout_s}

    async def close(self) -> None:
        await self._r.aclose()
