"""The embedded state (the default; one process, no server): in-flight work, outcome statistics,
idempotency keys, tenant quotas (``router.state.ledger``), the prefix index and sessions, as plain
in-process structures -- the same semantics and arithmetic as the Redis scripts
(``router.state.redis``), durable through the decision log (:meth:`EmbeddedState.rebuild`)."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs import prefix as px
from router.core.settings import STATS_ALPHA
from router.state.base import (
    Affinity,
    Claim,
    PoolStats,
    PrefixSend,
    Released,
    Reserved,
    RouterState,
    _check_reserve,
    _ewm,
    _finite,
)
from router.state.ledger import (
    RECORD_S,
    QuotaLedger,
    QuotaReserved,
    QuotaSettled,
    QuotaUsage,
    QuotaVerdict,
)
from xroute.schema.quota import WINDOW_S, QuotaBucket


@dataclass(slots=True)
class _Stats:
    outcomes: int = 0
    failures: int = 0
    failure_rate: float = 0.0
    ttft_n: int = 0
    ttft_mean: float = 0.0
    ttft_var: float = 0.0
    dur_n: int = 0
    dur_mean: float = 0.0
    dur_var: float = 0.0


@dataclass(slots=True)
class _Idem:
    answer: bytes | None  # None while pending
    until: float


class EmbeddedState(RouterState):
    """The state in this process (no server): dictionaries, and heaps of deadlines expired lazily.

    Durable through the decision log: after a restart, :meth:`rebuild` replays the log's events
    (``router.store.readers.decision_events``). ``clock`` is monotonic seconds (``time.monotonic``)."""

    backend = "embedded"
    sync = True

    def __init__(self, alpha: float = STATS_ALPHA, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, record_ttl_s: float = RECORD_S,
                 quota_window_s: float = WINDOW_S):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.clock = clock
        self._in_flight: dict[str, int] = {}
        self._held: dict[str, tuple[str, int, float]] = {}  # reservation id -> (pool, slots, until)
        self._due: list[tuple[float, str]] = []  # (until, reservation id); stale entries skipped
        self._expired: dict[str, int] = {}
        self._stats: dict[str, _Stats] = {}
        self._idem: dict[str, _Idem] = {}
        self._idem_due: list[tuple[float, str]] = []
        #: tenant quotas (wall clock: a quota day is a UTC day)
        self.quotas = QuotaLedger(wall_clock, record_ttl_s, quota_window_s)
        # prefix affinity (envs.prefix.HashedView over pool ids), sessions and predictions, with expiry
        self._pfx = px.HashedView()
        self._pfx_ids: dict[str, int] = {}
        self._pfx_pools: list[str] = []
        self._pfx_run = np.zeros(64, dtype=np.int64)
        self._sessions: dict[str, tuple[bytes, float]] = {}
        self._pred: dict[str, tuple[int, float, float]] = {}
        self._pfx_prune_at = 0.0

    # the synchronous core (the async methods are this with an await in front)
    def expire_now(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        due, held, n = self._due, self._held, 0
        while due and due[0][0] <= now:
            until, rid = heapq.heappop(due)
            h = held.get(rid)
            if h is not None and h[2] == until:
                del held[rid]
                self._in_flight[h[0]] -= h[1]
                self._expired[h[0]] = self._expired.get(h[0], 0) + 1
                n += 1
        if len(due) > 2 * len(held) + 1024:  # released long before their deadline: drop them
            self._due = [(u, r) for u, r in due if r in held and held[r][2] == u]
            heapq.heapify(self._due)
        return n

    def reserve_now(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                    slots: int = 1) -> str | None:
        now = self.clock()
        self.expire_now(now)
        held = self._held.get(reservation_id)
        if held is not None:
            return held[0]
        _check_reserve(candidates, hold_s, slots)
        in_flight = self._in_flight
        for pool, capacity in candidates:
            cur = in_flight.get(pool, 0)
            if cur + slots <= capacity:
                in_flight[pool] = cur + slots
                until = now + hold_s
                self._held[reservation_id] = (pool, slots, until)
                heapq.heappush(self._due, (until, reservation_id))
                return pool
        return None

    def release_now(self, reservation_id: str) -> str | None:
        h = self._held.pop(reservation_id, None)
        if h is None:
            return None
        self._in_flight[h[0]] -= h[1]
        return h[0]

    def observe_now(self, pool: str, ttft_ms: float | None = None, duration_ms: float | None = None,
                    failed: bool = False) -> None:
        _finite(ttft_ms, "ttft_ms")
        _finite(duration_ms, "duration_ms")
        s = self._stats.get(pool)
        if s is None:
            s = self._stats[pool] = _Stats()
        a = self.alpha
        s.failure_rate = _ewm(s.outcomes, s.failure_rate, 0.0, 1.0 if failed else 0.0, a)[0]
        s.outcomes += 1
        s.failures += bool(failed)
        if ttft_ms is not None:
            s.ttft_mean, s.ttft_var = _ewm(s.ttft_n, s.ttft_mean, s.ttft_var, ttft_ms, a)
            s.ttft_n += 1
        if duration_ms is not None:
            s.dur_mean, s.dur_var = _ewm(s.dur_n, s.dur_mean, s.dur_var, duration_ms, a)
            s.dur_n += 1

    def stats_now(self, pool: str) -> PoolStats:
        self.expire_now()
        s = self._stats.get(pool) or _Stats()
        return PoolStats(pool, s.outcomes, s.failures, s.failure_rate if s.outcomes else None,
                         s.ttft_mean if s.ttft_n else None, math.sqrt(s.ttft_var) if s.ttft_n else None,
                         s.dur_mean if s.dur_n else None, math.sqrt(s.dur_var) if s.dur_n else None,
                         self._in_flight.get(pool, 0), self._expired.get(pool, 0))

    def in_flight_now(self) -> dict[str, int]:
        self.expire_now()
        return {p: n for p, n in self._in_flight.items() if n}

    def durations_now(self, pools: Sequence[str]) -> dict[str, float]:
        out = {}
        for pool in pools:
            s = self._stats.get(pool)
            if s is not None and s.dur_n:
                out[pool] = s.dur_mean
        return out

    def _idem_expire(self, now: float) -> None:
        due, idem = self._idem_due, self._idem
        while due and due[0][0] <= now:
            until, key = heapq.heappop(due)
            e = idem.get(key)
            if e is not None and e.until == until:
                del idem[key]

    def claim_now(self, key: str, ttl_s: float) -> Claim:
        now = self.clock()
        self._idem_expire(now)
        e = self._idem.get(key)
        if e is not None:
            return Claim("pending") if e.answer is None else Claim("done", e.answer)
        self._set_idem(key, None, now + ttl_s)
        return Claim("new")

    def _set_idem(self, key: str, answer: bytes | None, until: float) -> None:
        self._idem[key] = _Idem(answer, until)
        heapq.heappush(self._idem_due, (until, key))

    def complete_now(self, key: str, answer: bytes, ttl_s: float) -> None:
        if not answer:
            raise ValueError("an idempotent answer must not be empty")
        self._set_idem(key, bytes(answer), self.clock() + ttl_s)

    def abandon_now(self, key: str) -> None:
        e = self._idem.get(key)
        if e is not None and e.answer is None:
            del self._idem[key]

    def quota_reserve_now(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                          hold_s: float) -> QuotaVerdict:
        return self.quotas.reserve(reservation_id, buckets, tokens, usd, hold_s)

    def quota_settle_now(self, reservation_id: str, tokens: int | None, usd: float | None) -> bool:
        return self.quotas.settle(reservation_id, tokens, usd)

    def quota_release_now(self, reservation_id: str) -> bool:
        return self.quotas.release(reservation_id)

    def quota_usage_now(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        return self.quotas.usage(keys)
    # prefix affinity and sessions (synchronous core)
    def _pool_id(self, pool: str) -> int:
        pid = self._pfx_ids.get(pool)
        if pid is None:
            pid = self._pfx_ids[pool] = len(self._pfx_pools)
            self._pfx_pools.append(pool)
            self._pfx.ensure_pools(pid + 1)
        return pid

    def prefix_lookup_now(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        now = self.clock()
        n = len(self._pfx_pools)
        runs: dict[str, int] = {}
        ret: dict[str, float] = {}
        if n and hashes.shape[0]:
            if self._pfx_run.shape[0] < n:
                self._pfx_run = np.zeros(2 * n, dtype=np.int64)
            run = self._pfx_run[:n]
            k = self._pfx.lookup(hashes, 0, n, now, now - ttl_s, run)
            if k:
                pools, retention = self._pfx_pools, self._pfx.retention
                for pid in self._pfx.matched[:k].tolist():
                    runs[pools[pid]] = int(run[pid])
                    ret[pools[pid]] = float(retention[pid])
        where = None
        if session is not None:
            got = self.get_session_now(session)
            where = None if got is None else got.decode()
        return Affinity(runs, ret, where)

    def prefix_record_now(self, decision_id: str, pool: str, send: PrefixSend) -> None:
        cand = send.candidates.get(pool)
        if cand is None:
            return
        cap, predicted, ready_in = cand
        now = self.clock()
        pid = self._pool_id(pool)
        if send.hashes.shape[0]:
            self._pfx.record(send.hashes, pid, now + ready_in, int(cap), now - send.ttl_s)
        if send.session is not None:
            self.put_session_now(send.session, pool.encode(), send.ttl_s)
        self._pred[decision_id] = (pid, float(predicted), now + send.ttl_s)
        if now >= self._pfx_prune_at:
            self._prune(now)

    def prefix_feedback_now(self, decision_id: str, cached_tokens: float, alpha: float) -> str | None:
        pred = self._pred.pop(decision_id, None)
        if pred is None or pred[2] < self.clock():
            return None
        px.retention_update(self._pfx.retention, pred[0], pred[1], float(cached_tokens), alpha)
        return self._pfx_pools[pred[0]]

    def get_session_now(self, session_id: str) -> bytes | None:
        got = self._sessions.get(session_id)
        if got is None or got[1] <= self.clock():
            return None
        return got[0]

    def put_session_now(self, session_id: str, value: bytes, ttl_s: float) -> None:
        self._sessions[session_id] = (bytes(value), self.clock() + ttl_s)

    def _prune(self, now: float) -> None:
        """Drop expired sessions and predictions (about once a minute: memory bounded by what the
        age bound keeps)."""
        self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
        self._pred = {k: v for k, v in self._pred.items() if v[2] > now}
        self._pfx_prune_at = now + 60.0

    # the interface
    async def reserve(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                      slots: int = 1) -> str | None:
        return self.reserve_now(candidates, reservation_id, hold_s, slots)

    async def quota_reserve(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                            hold_s: float) -> QuotaVerdict:
        return self.quotas.reserve(reservation_id, buckets, tokens, usd, hold_s)

    async def quota_settle(self, reservation_id: str, tokens: int | None, usd: float | None) -> bool:
        return self.quotas.settle(reservation_id, tokens, usd)

    async def quota_release(self, reservation_id: str) -> bool:
        return self.quotas.release(reservation_id)

    async def quota_usage(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        return self.quotas.usage(keys)
    async def prefix_lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        return self.prefix_lookup_now(hashes, session, ttl_s)

    async def prefix_record(self, decision_id: str, pool: str, send: PrefixSend) -> None:
        self.prefix_record_now(decision_id, pool, send)

    async def prefix_feedback(self, decision_id: str, cached_tokens: float, alpha: float) -> str | None:
        return self.prefix_feedback_now(decision_id, cached_tokens, alpha)

    async def get_session(self, session_id: str) -> bytes | None:
        return self.get_session_now(session_id)

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        self.put_session_now(session_id, value, ttl_s)

    async def release(self, reservation_id: str) -> str | None:
        return self.release_now(reservation_id)

    async def in_flight(self) -> dict[str, int]:
        return self.in_flight_now()

    async def expire(self) -> int:
        return self.expire_now()

    async def expired(self) -> dict[str, int]:
        self.expire_now()
        return dict(self._expired)

    async def observe(self, pool: str, ttft_ms: float | None = None, duration_ms: float | None = None,
                      failed: bool = False) -> None:
        self.observe_now(pool, ttft_ms, duration_ms, failed)

    async def stats(self, pool: str) -> PoolStats:
        return self.stats_now(pool)

    async def durations(self, pools: Sequence[str]) -> dict[str, float]:
        return self.durations_now(pools)

    async def claim(self, key: str, ttl_s: float) -> Claim:
        return self.claim_now(key, ttl_s)

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        self.complete_now(key, answer, ttl_s)

    async def abandon(self, key: str) -> None:
        self.abandon_now(key)

    # -------------------------------------------------------------- durability
    def rebuild(self, events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                now_wall: float | None = None) -> dict[str, int]:
        """Replay the reservation and release events of the decision log (oldest first; capacity is
        not checked: they were admitted). A reservation whose hold has passed by ``now_wall`` is
        expired at once, and counted. Quota events (``QuotaReserved``, ``QuotaSettled``) are booked
        in the tenant quota counters (``QuotaLedger.restore``). Returns counts of what was replayed."""
        now_wall = time.time() if now_wall is None else now_wall
        now = self.clock()
        out = {"reserved": 0, "released": 0, "held": 0}
        quota: list[QuotaReserved | QuotaSettled] = []
        for ev in events:
            if isinstance(ev, (QuotaReserved, QuotaSettled)):
                quota.append(ev)
            elif isinstance(ev, Reserved):
                if ev.reservation_id in self._held:
                    continue
                self._in_flight[ev.pool] = self._in_flight.get(ev.pool, 0) + ev.slots
                until = now + (ev.until - now_wall)
                self._held[ev.reservation_id] = (ev.pool, ev.slots, until)
                heapq.heappush(self._due, (until, ev.reservation_id))
                out["reserved"] += 1
            elif self.release_now(ev.reservation_id) is not None:
                out["released"] += 1
        out["expired"] = self.expire_now(now)
        out["held"] = len(self._held)
        if quota:
            out.update(self.quotas.restore(quota, now_wall))
        return out

    def restore_answers(self, answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None) -> int:
        """Idempotency keys after a restart: each ``(key, answer, until)`` (``until`` wall clock)
        completed again for what is left of its time (those past it are skipped). Returns how
        many were restored."""
        now_wall = time.time() if now_wall is None else now_wall
        n = 0
        for key, answer, until in answers:
            if until > now_wall and answer:
                self.complete_now(key, answer, until - now_wall)
                n += 1
        return n

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "reservations": len(self._held), "pools": len(self._in_flight)}
