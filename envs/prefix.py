"""KV-cache prefix caching: the servers' caches (the truth) and the router's record of what it sent
where (its view) -- compiled with numba, shared by the environment and the live router.

A prompt is cut into blocks of ``block_tokens`` tokens, each named by an id that covers the block
*and everything before it* (vLLM's block hashes chain each block's hash with its parent's; the
Mooncake trace's ``hash_ids`` are such a chain), so two prompts share exactly the leading blocks
whose ids agree, and a server can skip the prefill of the leading blocks it still holds.

**The truth** (:class:`PoolKV`, simulation only): every replica of a pool keeps an LRU cache of
blocks, ``capacity`` of them (the KV tokens its model leaves / ``block_tokens``). A request served
there:

* goes to the replica of the pool with the longest resident prefix of its blocks among the
  replicas with a free slot when it starts, the least loaded of those (the in-pool scheduler scores
  prefix and load, as llm-d's endpoint picker or Dynamo's KV router do); when none is free, to the
  replica of the slot that frees first;
* skips the prefill of its leading resident blocks (the hit; a block counts once the prefill that
  computes it has ended -- ``ready``) and pays the rest;
* then touches its blocks, the last block first and the first block last, so a prompt's leading
  blocks are the most recently used and its tail is evicted first (vLLM frees a sequence's blocks
  in reverse order for the same reason); absent blocks are inserted, each evicting the replica's
  least recently used block when it is full. A prompt longer than the cache keeps its leading
  ``capacity`` blocks.

``tests/test_prefix.py`` checks it against a plain reference implementation (``OrderedDict``
LRUs) on random block streams.

**The router's view** (:func:`view_lookup`, :func:`view_record`): what a router can know is what it
sent where. Per block, up to ``K`` (pool, stamp, time) entries -- the pools that most recently
received it, the time, and the pool's count of blocks received so far then (its stamp). A block
is taken to be resident on pool ``p`` when its entry there is

* younger than the age bound (``ttl_s``) and not older than the last time the router saw the pool
  lose its state (a preempted request of its own there), and
* fewer than ``cap[p]`` blocks were sent to ``p`` after it (``sent[p] - stamp < cap[p]``: an LRU
  of ``cap[p]`` blocks -- the pool's replicas' caches together -- would still hold it; counting
  every block sent, repeats included, makes the estimate conservative);

the pool's expected cached prefix is its leading run of such blocks, in tokens, times the pool's
*retention*: an exponentially weighted mean of the cached tokens the servers confirmed (the
``cached_tokens`` of their usage reports, the environment's completions) over those the view
predicted, which corrects the view where the servers evict sooner than it thinks (other traffic,
restarts, the in-pool scheduler placing a request on a replica without the prefix).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from numba import njit

#: entries kept per block in the view (the pools that most recently received it)
VIEW_ENTRIES = 4

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# ----------------------------------------------------------------------------------------- the view
# The view's rows: ``ent[row] = [key, (pool, stamp, time in us) x K]`` as int64 -- one array, a
# block's key and entries on one or two cache lines (a lookup touches up to 64 blocks of an index
# that may hold millions: a cache miss each is most of its cost). ``key`` is the block's hash in a
# hashed view (unused where rows are dense block ids); an empty entry has pool -1 and the lowest
# time. Times are integer microseconds (:func:`us`).
_ROW0 = 1
_NO_TIME = np.iinfo(np.int64).min


def us(t: float) -> int:
    """A time in seconds as the view stores it (integer microseconds; -inf the lowest)."""
    return round(t * 1e6) if math.isfinite(t) else (_NO_TIME if t < 0 else np.iinfo(np.int64).max)


def us_array(t: np.ndarray) -> np.ndarray:
    out = np.full(t.shape, _NO_TIME, dtype=np.int64)
    ok = np.isfinite(t)
    out[ok] = np.round(t[ok] * 1e6).astype(np.int64)
    out[np.isposinf(t)] = np.iinfo(np.int64).max
    return out


@njit(cache=True)
def _row_run(ent, b, i, p0, n, now, cutoff, valid_from, sent, cap, run):  # pragma: no cover
    """Advance the pools of ``p0 .. p0 + n - 1`` whose run reached block ``i`` and whose entry in
    ``ent[b]`` still counts (module docstring). Returns whether any did."""
    adv = False
    for c in range(_ROW0, ent.shape[1], 3):
        a = ent[b, c] - p0
        if a < 0 or a >= n or run[a] != i:
            continue
        t = ent[b, c + 2]
        if t > now or t < cutoff or t < valid_from[a] or sent[ent[b, c]] - ent[b, c + 1] >= cap[ent[b, c]]:
            continue
        run[a] = i + 1
        adv = True
    return adv


@njit(cache=True)
def view_lookup(ent, sent, cap, rows, p0, n, now, cutoff, valid_from, run):  # pragma: no cover
    """The router's view of the current request on pools ``p0 .. p0 + n - 1`` at ``now``: ``run[a]``
    = the leading blocks of ``rows`` (the blocks' rows in the view; -1 = never recorded) deemed
    resident on pool ``p0 + a`` (module docstring); an entry's time is when the router expected the
    block computed there (its request's expected first token), so entries later than ``now`` (not
    computed yet), older than ``cutoff`` (the age bound) or than ``valid_from[a]`` (the pool lost
    its state since) do not count. Times in microseconds. Returns the longest run."""
    for a in range(n):
        run[a] = 0
    best = 0
    for i in range(rows.shape[0]):
        b = rows[i]
        if b < 0 or not _row_run(ent, b, i, p0, n, now, cutoff, valid_from, sent, cap, run):
            break
        best = i + 1
    return best


@njit(cache=True)
def view_record(ent, sent, rows, p, t):  # pragma: no cover
    """The router sent a request with the blocks of ``rows`` to pool ``p``, expecting them computed
    there at ``t`` (microseconds): each block's entry for ``p`` (or, when it has none, its oldest
    entry) now says so; stamps run so that the first block is the most recent (module docstring);
    the pool's count grows by the blocks."""
    n_blocks = rows.shape[0]
    base = sent[p]
    for i in range(n_blocks):
        b = rows[i]
        slot = -1
        oldest = _ROW0
        for c in range(_ROW0, ent.shape[1], 3):
            if ent[b, c] == p:
                slot = c
                break
            if ent[b, c + 2] < ent[b, oldest + 2]:
                oldest = c
        if slot < 0:
            slot = oldest
        ent[b, slot] = p
        ent[b, slot + 1] = base + (n_blocks - 1 - i)
        ent[b, slot + 2] = t
    sent[p] = base + n_blocks


@njit(cache=True)
def view_expect(ent, sent, cap, rows, p0, n, now, cutoff, valid_from, block_tokens, input_tokens, retention, run,
                view_tokens, cached):  # pragma: no cover
    """:func:`view_lookup`, then the prompt tokens the view expects on each pool (``view_tokens``:
    ``min(run x block_tokens, input_tokens)``) and those times the pools' ``retention`` (``cached``)."""
    best = view_lookup(ent, sent, cap, rows, p0, n, now, cutoff, valid_from, run)
    for a in range(n):
        c = run[a] * block_tokens
        if c > input_tokens:
            c = input_tokens
        view_tokens[a] = c
        cached[a] = c * retention[p0 + a]
    return best


@njit(cache=True)
def expected_cached(run, block_tokens, input_tokens, retention, out):  # pragma: no cover
    """Expected cached tokens of each pool: ``min(run x block_tokens, input_tokens) x retention``."""
    for a in range(run.shape[0]):
        c = run[a] * block_tokens
        if c > input_tokens:
            c = input_tokens
        out[a] = c * retention[a]


@njit(cache=True)
def retention_update(retention, p, predicted, confirmed, alpha):  # pragma: no cover
    """Fold one confirmation into pool ``p``'s retention (when the view predicted any cached tokens)."""
    if predicted <= 0.0:
        return
    x = confirmed / predicted
    if x > 1.0:
        x = 1.0
    elif x < 0.0:
        x = 0.0
    retention[p] += alpha * (x - retention[p])


#: an empty slot of a hashed view's table (a client hash equal to it is taken as the next value)
EMPTY_KEY = np.iinfo(np.int64).min


@njit(cache=True)
def _mix(key, mask):  # pragma: no cover
    return np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(20)) & mask


@njit(cache=True)
def _slot(ent, h):  # pragma: no cover
    """The slot of ``h`` in a hashed view (its keys in column 0), or of the empty slot where it would go."""
    mask = ent.shape[0] - 1
    j = _mix(h, mask)
    while ent[j, 0] != EMPTY_KEY and ent[j, 0] != h:
        j = (j + 1) & mask
    return j


@njit(cache=True)
def hashed_lookup(ent, sent, cap, hashes, p0, n, now, cutoff, valid_from, run, matched):  # pragma: no cover
    """:func:`view_lookup` over a hashed view (``ent``'s rows an open-addressing table keyed by
    column 0, a power of two, at most half full): the blocks found by their hashes as it goes. The
    pools with a run > 0 go into ``matched`` (returns how many)."""
    for a in range(n):
        run[a] = 0
    n_h = hashes.shape[0]
    slots = np.empty(8, dtype=np.int64)
    i = 0
    go = True
    while go and i < n_h:
        # eight blocks' slots first: independent loads the memory system overlaps (the index is
        # large and its rows scattered), then their entries, now in cache
        m = min(8, n_h - i)
        for q in range(m):
            h = hashes[i + q]
            if h == EMPTY_KEY:
                h += 1
            slots[q] = _slot(ent, h)
        for q in range(m):
            b = slots[q]
            if ent[b, 0] == EMPTY_KEY or not _row_run(ent, b, i + q, p0, n, now, cutoff, valid_from, sent, cap, run):
                go = False
                break
        i += m
    k = 0
    for a in range(n):
        if run[a] > 0:
            matched[k] = a
            k += 1
    return k


@njit(cache=True)
def hashed_rows(ent, hashes, rows):  # pragma: no cover
    """The rows of ``hashes``, inserted where absent; returns how many were new."""
    added = 0
    for i in range(hashes.shape[0]):
        h = hashes[i]
        if h == EMPTY_KEY:
            h += 1
        j = _slot(ent, h)
        if ent[j, 0] == EMPTY_KEY:
            ent[j, 0] = h
            added += 1
        rows[i] = j
    return added


@njit(cache=True)
def _table_rehash(ent, keep_from, n_ent):  # pragma: no cover
    """Copy the rows with an entry at or after ``keep_from`` into the (larger, empty) new table."""
    kept = 0
    for s in range(ent.shape[0]):
        if ent[s, 0] == EMPTY_KEY:
            continue
        alive = False
        for c in range(_ROW0, ent.shape[1], 3):
            if ent[s, c] >= 0 and ent[s, c + 2] >= keep_from:
                alive = True
        if not alive:
            continue
        j = _slot(n_ent, ent[s, 0])
        n_ent[j] = ent[s]
        kept += 1
    return kept


def new_view_rows(rows: int, k: int = VIEW_ENTRIES, hashed: bool = False) -> np.ndarray:
    """Empty view rows for ``rows`` blocks: keys empty (``hashed``), entries pool -1, no time."""
    ent = np.zeros((rows, _ROW0 + 3 * k), dtype=np.int64)
    ent[:, _ROW0::3] = -1
    ent[:, _ROW0 + 2::3] = _NO_TIME
    if hashed:
        ent[:, 0] = EMPTY_KEY
    return ent


class HashedView:
    """The router's view keyed by the clients' block hashes (any int64): an open-addressing table
    whose rows hold the view's entries, grown (and its expired rows dropped) as it fills. Pools
    are small ints the caller assigns; times are seconds (stored as microseconds). The in-process
    shared state (``router.state.embedded.EmbeddedState``) keeps one; the environment, which knows its
    stream's blocks in advance, indexes the entries by dense block ids instead. Memory: 8 x (1 + 3
    x ``k``) bytes a slot, two to four slots a block recorded within the age bound."""

    def __init__(self, pools: int = 64, rows: int = 1024, k: int = VIEW_ENTRIES):
        size = 1 << max(4, math.ceil(math.log2(max(rows, 8) * 2)))
        self.ent = new_view_rows(size, k, hashed=True)
        self.n_rows = 0
        self.sent = np.zeros(pools, dtype=np.int64)
        self.cap = np.zeros(pools, dtype=np.int64)
        self.retention = np.ones(pools)
        self._rows = np.zeros(256, dtype=np.int64)
        self._valid_from = np.full(pools, _NO_TIME, dtype=np.int64)
        self.matched = np.zeros(pools, dtype=np.int64)

    def ensure_pools(self, n: int) -> None:
        if n > self.sent.shape[0]:
            m = max(n, 2 * self.sent.shape[0])
            self.sent = np.concatenate([self.sent, np.zeros(m - self.sent.shape[0], dtype=np.int64)])
            self.cap = np.concatenate([self.cap, np.zeros(m - self.cap.shape[0], dtype=np.int64)])
            self.retention = np.concatenate([self.retention, np.ones(m - self.retention.shape[0])])
            self._valid_from = np.full(m, _NO_TIME, dtype=np.int64)
            self.matched = np.zeros(m, dtype=np.int64)

    def _grow(self, need: int, keep_from: float) -> None:
        size = self.ent.shape[0]
        while 2 * need > size // 2:  # after the rehash, at most a quarter full
            size *= 2
        ent = new_view_rows(size, (self.ent.shape[1] - _ROW0) // 3, hashed=True)
        self.n_rows = int(_table_rehash(self.ent, us(keep_from), ent))
        self.ent = ent

    def lookup(self, hashes: np.ndarray, p0: int, n: int, now: float, cutoff: float, run: np.ndarray) -> int:
        """``run[a]`` for the pools ``p0 .. p0 + n - 1`` (:func:`hashed_lookup`); the pools that
        matched are ``self.matched[:k]`` (``p0 +``), ``k`` returned."""
        if p0 + n > self.sent.shape[0]:
            self.ensure_pools(p0 + n)
        return int(hashed_lookup(self.ent, self.sent, self.cap, hashes, p0, n, us(now), us(cutoff), self._valid_from,
                                 run, self.matched))

    def record(self, hashes: np.ndarray, pool: int, t: float, cap: int, keep_from: float) -> None:
        """``hashes`` sent to ``pool``, expected computed at ``t``; the pool's capacity in blocks."""
        self.ensure_pools(pool + 1)
        self.cap[pool] = cap
        n = hashes.shape[0]
        if 2 * (self.n_rows + n) > self.ent.shape[0]:
            self._grow(self.n_rows + n, keep_from)
        if n > self._rows.shape[0]:
            self._rows = np.zeros(2 * n, dtype=np.int64)
        rows = self._rows[:n]
        self.n_rows += int(hashed_rows(self.ent, hashes, rows))
        view_record(self.ent, self.sent, rows, pool, us(t))


# ---------------------------------------------------------------------------------------- the truth
@njit(cache=True)
def _find(h_key, h_val, key):  # pragma: no cover
    """The slot holding ``key`` in a node table, or -1."""
    mask = h_key.shape[0] - 1
    j = _mix(key, mask)
    while h_val[j] >= 0:
        if h_key[j] == key:
            return j
        j = (j + 1) & mask
    return -1


@njit(cache=True)
def _insert(h_key, h_val, key, node):  # pragma: no cover
    mask = h_key.shape[0] - 1
    j = _mix(key, mask)
    while h_val[j] >= 0:
        j = (j + 1) & mask
    h_key[j] = key
    h_val[j] = node


@njit(cache=True)
def _delete(h_key, h_val, i):  # pragma: no cover
    """Remove slot ``i`` of a linear-probing table, shifting later entries of its cluster back."""
    mask = h_key.shape[0] - 1
    j = i
    while True:
        h_val[i] = -1
        while True:
            j = (j + 1) & mask
            if h_val[j] < 0:
                return
            home = _mix(h_key[j], mask)
            if i <= j:
                if i < home <= j:
                    continue
            elif home > i or home <= j:
                continue
            break
        h_key[i] = h_key[j]
        h_val[i] = h_val[j]
        i = j


@njit(cache=True)
def _unlink(n_prev, n_next, r_head, r_tail, r, node):  # pragma: no cover
    p, q = n_prev[node], n_next[node]
    if p >= 0:
        n_next[p] = q
    else:
        r_head[r] = q
    if q >= 0:
        n_prev[q] = p
    else:
        r_tail[r] = p


@njit(cache=True)
def _push_head(n_prev, n_next, r_head, r_tail, r, node):  # pragma: no cover
    n_prev[node] = -1
    n_next[node] = r_head[r]
    if r_head[r] >= 0:
        n_prev[r_head[r]] = node
    r_head[r] = node
    if r_tail[r] < 0:
        r_tail[r] = node


@njit(cache=True)
def kv_runs(h_key, h_val, n_ready, n_rep, blocks, t, consider, runs):  # pragma: no cover
    """``runs[r]`` = the leading ``blocks`` resident and ready by ``t`` on each replica ``r`` with
    ``consider[r]`` (0 elsewhere)."""
    n_rep_ = runs.shape[0]
    for r in range(n_rep_):
        runs[r] = 0
        if not consider[r]:
            continue
        k = 0
        for i in range(blocks.shape[0]):
            s = _find(h_key, h_val, blocks[i] * n_rep_ + r)
            if s < 0 or n_ready[h_val[s]] > t:
                break
            k += 1
        runs[r] = k


@njit(cache=True)
def kv_place(h_key, h_val, n_ready, n_rep, free_row, conc, n_replicas, t, blocks, runs, consider):  # pragma: no cover
    """The in-pool scheduler's choice for a request arriving at ``t`` (module docstring): among the
    replicas with a slot free at ``t`` the one with the longest ready prefix, the least loaded (most
    free slots) of those, the first of those; the replica of the slot that frees first when none
    is free. ``free_row``: the pool's slots' release times (slot ``j`` on replica ``j // conc``).
    Returns (slot: the chosen replica's first free one, the hit in blocks)."""
    n_any = 0
    j0 = 0
    last = n_replicas * conc
    for j in range(last):
        if free_row[j] < free_row[j0]:
            j0 = j
    for r in range(n_replicas):
        consider[r] = False
        for j in range(r * conc, (r + 1) * conc):
            if free_row[j] <= t:
                consider[r] = True
                break
        if consider[r]:
            n_any += 1
    if n_any == 0:
        consider[j0 // conc] = True
    kv_runs(h_key, h_val, n_ready, n_rep, blocks, t, consider, runs)
    best = -1
    best_free = -1
    for r in range(n_replicas):
        if not consider[r]:
            continue
        if best >= 0 and runs[r] < runs[best]:
            continue
        n_free = 0
        for j in range(r * conc, (r + 1) * conc):
            if free_row[j] <= t:
                n_free += 1
        if best < 0 or runs[r] > runs[best] or n_free > best_free:
            best = r
            best_free = n_free
    j = best * conc
    for s in range(best * conc, (best + 1) * conc):
        if free_row[s] < free_row[j]:
            j = s
    return j, runs[best]


@njit(cache=True)
def kv_fill(h_key, h_val, n_block, n_rep, n_prev, n_next, n_ready, r_head, r_tail, r_size, meta, capacity, r,
            blocks, ready):  # pragma: no cover
    """Replica ``r`` served a request with ``blocks``: touch them last block first (module
    docstring); a block not resident is inserted, ready at ``ready``, evicting the replica's least
    recently used block when it holds ``capacity``. ``meta[0]``: nodes allocated (the caller
    makes room: :meth:`PoolKV.reserve`). Returns the blocks evicted."""
    n_replicas = r_head.shape[0]
    evicted = 0
    if capacity <= 0:
        return 0
    for q in range(blocks.shape[0] - 1, -1, -1):
        b = blocks[q]
        key = b * n_replicas + r
        s = _find(h_key, h_val, key)
        if s >= 0:
            node = h_val[s]
            _unlink(n_prev, n_next, r_head, r_tail, r, node)
            _push_head(n_prev, n_next, r_head, r_tail, r, node)
            continue
        if r_size[r] >= capacity:
            node = r_tail[r]
            _unlink(n_prev, n_next, r_head, r_tail, r, node)
            _delete(h_key, h_val, _find(h_key, h_val, n_block[node] * n_replicas + r))
            r_size[r] -= 1
            evicted += 1
        else:
            node = meta[0]
            meta[0] += 1
        n_block[node] = b
        n_rep[node] = r
        n_ready[node] = ready
        _push_head(n_prev, n_next, r_head, r_tail, r, node)
        _insert(h_key, h_val, key, node)
        r_size[r] += 1
    return evicted


@njit(cache=True)
def kv_serve(h_key, h_val, n_block, n_rep, n_prev, n_next, n_ready, r_head, r_tail, r_size, meta, capacity, free_row,
             conc, t, blocks, block_tokens, input_tokens, prefill_s_per_token, runs, consider):  # pragma: no cover
    """:func:`kv_place` then :func:`kv_fill` in one call, the blocks ready when the prefill of the
    tokens not cached ends (``prefill_s_per_token`` each, from the chosen slot's start). Returns
    (slot, hit in blocks)."""
    n_replicas = r_head.shape[0]
    j, hit = kv_place(h_key, h_val, n_ready, n_rep, free_row, conc, n_replicas, t, blocks, runs, consider)
    start = free_row[j] if free_row[j] > t else t
    cached = hit * block_tokens
    if cached > input_tokens:
        cached = input_tokens
    kv_fill(h_key, h_val, n_block, n_rep, n_prev, n_next, n_ready, r_head, r_tail, r_size, meta, capacity, j // conc,
            blocks, start + (input_tokens - cached) * prefill_s_per_token)
    return j, hit


@njit(cache=True)
def _kv_rehash(n_block, n_rep, used, n_replicas, h_key, h_val):  # pragma: no cover
    for node in range(used):
        _insert(h_key, h_val, n_block[node] * n_replicas + n_rep[node], node)


_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A fresh ownership token (:class:`PoolKV` copy-on-write)."""
    return next(_OWNERS)


class PoolKV:
    """The caches of one pool's ``replicas`` replicas, ``capacity`` blocks each (the truth; module
    docstring). Its arrays grow as blocks arrive (up to ``replicas x capacity`` nodes). ``owner``:
    the token of the environment that may change it in place -- any other copies it first
    (:meth:`CloudRouteEnv` snapshots share pools until one of them writes)."""

    __slots__ = ("_consider", "_runs", "capacity", "cleared_at", "h_key", "h_val", "meta", "n_block", "n_next",
                 "n_prev", "n_ready", "n_rep", "owner", "r_head", "r_size", "r_tail", "replicas")

    def __init__(self, replicas: int, capacity: int, owner: int = 0, cleared_at: float = -math.inf, nodes: int = 64):
        self.replicas, self.capacity, self.owner, self.cleared_at = int(replicas), int(capacity), owner, cleared_at
        self.r_head = np.full(self.replicas, -1, dtype=np.int32)
        self.r_tail = np.full(self.replicas, -1, dtype=np.int32)
        self.r_size = np.zeros(self.replicas, dtype=np.int32)
        self.meta = np.zeros(2, dtype=np.int64)
        self._runs = np.zeros(self.replicas, dtype=np.int64)  # scratch (no state)
        self._consider = np.zeros(self.replicas, dtype=np.bool_)
        self._alloc(max(1, min(max(nodes, 16), self.replicas * self.capacity)))

    def _alloc(self, nodes: int) -> None:
        self.n_block = np.zeros(nodes, dtype=np.int64)
        self.n_rep = np.zeros(nodes, dtype=np.int32)
        self.n_prev = np.full(nodes, -1, dtype=np.int32)
        self.n_next = np.full(nodes, -1, dtype=np.int32)
        self.n_ready = np.zeros(nodes)
        size = 1 << max(5, math.ceil(math.log2(2 * nodes)))
        self.h_key = np.zeros(size, dtype=np.int64)
        self.h_val = np.full(size, -1, dtype=np.int32)

    def reserve(self, n_blocks: int) -> None:
        """Room for ``n_blocks`` new nodes (at most the pool's total capacity)."""
        used = int(self.meta[0])
        have = self.n_block.shape[0]
        if used + n_blocks <= have or have >= self.replicas * self.capacity:
            return
        old: list[np.ndarray] = [self.n_block, self.n_rep, self.n_prev, self.n_next, self.n_ready]
        self._alloc(min(max(2 * have, used + n_blocks), self.replicas * self.capacity))
        new: list[np.ndarray] = [self.n_block, self.n_rep, self.n_prev, self.n_next, self.n_ready]
        for a, o in zip(new, old):
            a[:used] = o[:used]
        _kv_rehash(self.n_block, self.n_rep, used, self.replicas, self.h_key, self.h_val)

    def copy(self, owner: int) -> PoolKV:
        c = PoolKV.__new__(PoolKV)
        c.replicas, c.capacity, c.owner, c.cleared_at = self.replicas, self.capacity, owner, self.cleared_at
        c._runs, c._consider = self._runs, self._consider
        for k in ("r_head", "r_tail", "r_size", "meta", "n_block", "n_rep", "n_prev", "n_next", "n_ready", "h_key",
                  "h_val"):
            setattr(c, k, getattr(self, k).copy())
        return c

    def place(self, free_row: np.ndarray, conc: int, t: float, blocks: np.ndarray) -> tuple[int, int]:
        """(slot, hit in blocks) of a request arriving at ``t`` (:func:`kv_place`); changes nothing."""
        j, hit = kv_place(self.h_key, self.h_val, self.n_ready, self.n_rep, free_row, conc, self.replicas, t, blocks,
                          self._runs, self._consider)
        return j, hit

    def serve(self, free_row: np.ndarray, conc: int, t: float, blocks: np.ndarray, block_tokens: int,
              input_tokens: float, prefill_s_per_token: float) -> tuple[int, int]:
        """:meth:`place` then :meth:`fill` (:func:`kv_serve`): the request is served; (slot, hit)."""
        self.reserve(blocks.shape[0])
        return kv_serve(self.h_key, self.h_val, self.n_block, self.n_rep, self.n_prev, self.n_next, self.n_ready,  # type: ignore[no-any-return]
                        self.r_head, self.r_tail, self.r_size, self.meta, self.capacity, free_row, conc, t, blocks,
                        block_tokens, input_tokens, prefill_s_per_token, self._runs, self._consider)

    def fill(self, r: int, blocks: np.ndarray, ready: float) -> int:
        """Replica ``r`` served ``blocks`` (:func:`kv_fill`); returns the blocks evicted."""
        self.reserve(blocks.shape[0])
        return int(kv_fill(self.h_key, self.h_val, self.n_block, self.n_rep, self.n_prev, self.n_next, self.n_ready,
                           self.r_head, self.r_tail, self.r_size, self.meta, self.capacity, r, blocks, ready))

    def resident(self, r: int) -> list[int]:
        """Replica ``r``'s blocks, most recently used first (for tests and inspection)."""
        out, node = [], int(self.r_head[r])
        while node >= 0:
            out.append(int(self.n_block[node]))
            node = int(self.n_next[node])
        return out


def warm_up() -> None:
    """Compile (or load from the cache) every kernel now."""
    ent = new_view_rows(4)
    sent, cap = np.zeros(2, dtype=np.int64), np.full(2, 10, dtype=np.int64)
    rows = np.arange(2, dtype=np.int64)
    view_record(ent, sent, rows, 0, 1)
    run = np.zeros(2, dtype=np.int64)
    vf = np.full(2, _NO_TIME, dtype=np.int64)
    view_lookup(ent, sent, cap, rows, 0, 2, 1, 0, vf, run)
    view_expect(ent, sent, cap, rows, 0, 2, 1, 0, vf, 512, 100.0, np.ones(2), run, np.zeros(2), np.zeros(2))
    expected_cached(run, 512, 100.0, np.ones(2), np.zeros(2))
    retention_update(np.ones(2), 0, 1.0, 0.5, 0.1)
    hv = HashedView(2, 8)
    hv.record(np.array([5, -7], dtype=np.int64), 1, 1.0, 4, 0.0)
    hv.lookup(np.array([5, -7], dtype=np.int64), 0, 2, 1.0, 0.0, run)
    hv._grow(64, 0.0)
    kv = PoolKV(2, 4)
    j, hit = kv.place(np.zeros(2), 1, 0.0, rows)
    kv.fill(j, rows, 0.0)
    kv.serve(np.zeros(2), 1, 0.0, rows, 512, 100.0, 1e-4)
