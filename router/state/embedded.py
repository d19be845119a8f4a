"""The embedded state (the default; one process, no server): in-flight work, outcome statistics,
idempotency keys, tenant quotas (``router.state.ledger``), the prefix index and sessions, as plain
in-process structures -- the same semantics and arithmetic as the Redis scripts
(``router.state.redis``), durable through the decision log (:meth:`EmbeddedCore.rebuild`).

One synchronous core (:class:`EmbeddedCore`: every operation a plain call) and one generic async
adapter (:func:`awaited`): :class:`EmbeddedState` is the core's operations as the coroutines
``router.service.ports`` declares -- an ``await`` that never suspends, so nothing else runs between
a decision's ranking and its admission."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from envs import prefix as px
from router.core.settings import STATS_ALPHA
from router.state.base import (
    Admission,
    Admitted,
    Affinity,
    Claim,
    Ejection,
    EjectionRule,
    Epoch,
    PoolOutcome,
    PrefixSend,
    Released,
    Reserved,
    Settled,
    Settlement,
    StateView,
    _check_reserve,
    _ewm,
    _finite,
    as_ejection,
    check_rule,
    ejection_step,
)
from router.state.ledger import (
    RECORD_S,
    QuotaLedger,
    QuotaReserved,
    QuotaSettled,
    QuotaUsage,
)
from xroute import admission_rules as rules
from xroute.schema.quota import WINDOW_S


@dataclass(slots=True)
class PoolOutcomes:
    """One pool's outcome statistics (``router.state.base``'s estimator), as the core keeps them."""

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


class EmbeddedCore:
    """The state in this process, synchronous (no server): dictionaries, and heaps of deadlines
    expired lazily. Every operation of ``router.service.ports`` as a plain call.

    Durable through the decision log: after a restart, :meth:`rebuild` replays the log's events
    (``router.store.readers.decision_events``). ``clock`` is monotonic seconds (``time.monotonic``)."""

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
        #: each pool's outcome statistics
        self.stats: dict[str, PoolOutcomes] = {}
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
        #: the tenants' fairness counters (``router.state.base``)
        self.fair: dict[str, float] = {}
        #: outlier ejection: target -> [failures, streak, ejections, until ms, probe lease ms, back since ms]
        self._ej: dict[str, list[int]] = {}

    # -------------------------------------------------------------- the decision path
    def admit(self, a: Admission) -> Admitted:
        """``router.state.base.Admission``: the first candidate with room, the quotas, the prefix's
        record -- all or nothing."""
        now = self.clock()
        self._expire(now)
        held = self._held.get(a.reservation_id)
        if held is not None:
            return Admitted(held[0])
        _check_reserve(a.candidates, a.hold_s, a.slots)
        in_flight, slots = self._in_flight, a.slots
        for pool, capacity in a.candidates:
            if in_flight.get(pool, 0) + slots <= capacity:
                break
        else:
            return Admitted(None)
        q = a.quota
        if q is not None:
            verdict = self.quotas.reserve(a.reservation_id, q.buckets, q.tokens, q.usd, a.hold_s)
            if not verdict.ok:
                return Admitted(None, verdict)
        in_flight[pool] = in_flight.get(pool, 0) + slots
        until = now + a.hold_s
        self._held[a.reservation_id] = (pool, slots, until)
        heapq.heappush(self._due, (until, a.reservation_id))
        if a.prefix is not None:
            self._record(a.reservation_id, pool, a.prefix)
        if a.fair is not None:
            self.fair[a.fair[0]] = self.fair.get(a.fair[0], 0.0) + a.fair[1]
        return Admitted(pool)

    def settle(self, s: Settlement) -> Settled:
        """``router.state.base.Settlement``: release, statistics, quotas, prefix retention."""
        if s.outcome is not None:
            _finite(s.outcome.ttft_ms, "ttft_ms")
            _finite(s.outcome.duration_ms, "duration_ms")
        pool = self._release(s.reservation_id) if s.release else None
        if s.outcome is not None:
            self._observe(s.outcome)
        quota = False
        if s.quota is not None:
            quota = (self.quotas.release(s.reservation_id) if s.quota.undo else
                     self.quotas.settle(s.reservation_id, s.quota.tokens, s.quota.usd))
        learned = None
        if s.cached_tokens is not None:
            learned = self._retention(s.reservation_id, s.cached_tokens, s.retention_alpha)
        if s.fair is not None:
            self.fair[s.fair[0]] = self.fair.get(s.fair[0], 0.0) + s.fair[1]
        return Settled(pool, quota, learned)

    def fairness(self, tenants: Sequence[str], lift: Sequence[str] = ()) -> dict[str, float]:
        """The fairness counters of ``tenants`` (the backlogged ones), after lifting each tenant of
        ``lift`` (just backlogged) to the lowest counter of the others (``xroute.admission_rules.lift``)."""
        fair = self.fair
        if lift:
            lifting = set(lift)
            others = [fair.get(t, 0.0) for t in tenants if t not in lifting]
            for t in lift:
                fair[t] = rules.lift(fair.get(t, 0.0), others)
        return {t: fair.get(t, 0.0) for t in tenants}

    def lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        """The pools expected to hold the leading blocks of ``hashes`` (int64, prompt order) now, by
        the index's record (``envs.prefix.view_lookup``: an entry counts once its blocks are
        expected computed, within ``ttl_s``, and while fewer than the pool's capacity of blocks were
        sent there after it), and where ``session`` last went."""
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
            got = self._sessions.get(session)
            where = None if got is None or got[1] <= now else got[0].decode()
        return Affinity(runs, ret, where)

    def view(self, quota_keys: Sequence[str] = (), durations: bool = False) -> StateView:
        self._expire(self.clock())
        in_flight = {p: n for p, n in self._in_flight.items() if n}
        durs = {}
        if durations:
            for pool in in_flight:
                st = self.stats.get(pool)
                if st is not None and st.dur_n:
                    durs[pool] = st.dur_mean
        return StateView(in_flight, dict(self._expired), durs, self.quotas.usage(quota_keys) if quota_keys else {})

    def quota_usage(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        """The buckets' usage now, exact (what the decisions read in this process: ``quota_reader``)."""
        return self.quotas.usage(keys)

    def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        self._sessions[session_id] = (bytes(value), self.clock() + ttl_s)

    def report(self, outcomes: Sequence[tuple[str, bool]], rule: EjectionRule) -> list[Ejection]:
        """Attempts' outcomes ``(target, failed)`` folded into the targets' ejection records, in
        order (``router.state.base.ejection_step``); each target's health after its outcome."""
        check_rule(rule)
        now = round(self.clock() * 1000)
        out = []
        for target, failed in outcomes:
            rec = self._ej.get(target)
            if rec is None:
                rec = [0, 0, 0, 0, 0, 0]
                if failed:
                    self._ej[target] = rec
            ejected = ejection_step(rec, bool(failed), now, rule)
            out.append(as_ejection(target, rec, now, ejected_now=ejected))
        return out

    def ejections(self, probe: Sequence[str] = (), lease_s: float = 0.0) -> list[Ejection]:
        """Every target ejected, half-open or with failures counted; the probe of each half-open
        one of ``probe`` whose lease is free is the caller's for ``lease_s`` (``probe`` True)."""
        now = round(self.clock() * 1000)
        mine = frozenset(probe)
        lease = max(1, round(lease_s * 1000))
        out = []
        for target, rec in self._ej.items():
            if not rec[0] and not rec[3]:
                continue
            took = False
            if rec[3] and rec[3] <= now and rec[4] <= now and target in mine:
                rec[4] = now + lease
                took = True
            out.append(as_ejection(target, rec, now, took))
        return out

    # -------------------------------------------------------------- its parts
    def _expire(self, now: float) -> int:
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

    def _release(self, reservation_id: str) -> str | None:
        h = self._held.pop(reservation_id, None)
        if h is None:
            return None
        self._in_flight[h[0]] -= h[1]
        return h[0]

    def _observe(self, o: PoolOutcome) -> None:
        s = self.stats.get(o.pool)
        if s is None:
            s = self.stats[o.pool] = PoolOutcomes()
        a = self.alpha
        s.failure_rate = _ewm(s.outcomes, s.failure_rate, 0.0, 1.0 if o.failed else 0.0, a)[0]
        s.outcomes += 1
        s.failures += bool(o.failed)
        if o.ttft_ms is not None:
            s.ttft_mean, s.ttft_var = _ewm(s.ttft_n, s.ttft_mean, s.ttft_var, o.ttft_ms, a)
            s.ttft_n += 1
        if o.duration_ms is not None:
            s.dur_mean, s.dur_var = _ewm(s.dur_n, s.dur_mean, s.dur_var, o.duration_ms, a)
            s.dur_n += 1

    def _pool_id(self, pool: str) -> int:
        pid = self._pfx_ids.get(pool)
        if pid is None:
            pid = self._pfx_ids[pool] = len(self._pfx_pools)
            self._pfx_pools.append(pool)
            self._pfx.ensure_pools(pid + 1)
        return pid

    def _record(self, decision_id: str, pool: str, send: PrefixSend) -> None:
        """The decision sent ``send.hashes`` (and its session) to ``pool``, one of
        ``send.candidates``; the prediction is kept for its settlement for ``send.ttl_s``."""
        cand = send.candidates.get(pool)
        if cand is None:
            return
        cap, predicted, ready_in = cand
        now = self.clock()
        pid = self._pool_id(pool)
        if send.hashes.shape[0]:
            self._pfx.record(send.hashes, pid, now + ready_in, int(cap), now - send.ttl_s)
        if send.session is not None:
            self.put_session(send.session, pool.encode(), send.ttl_s)
        self._pred[decision_id] = (pid, float(predicted), now + send.ttl_s)
        if now >= self._pfx_prune_at:
            self._prune(now)

    def _retention(self, decision_id: str, cached_tokens: float, alpha: float) -> str | None:
        pred = self._pred.pop(decision_id, None)
        if pred is None or pred[2] < self.clock():
            return None
        px.retention_update(self._pfx.retention, pred[0], pred[1], float(cached_tokens), alpha)
        return self._pfx_pools[pred[0]]

    def _prune(self, now: float) -> None:
        """Drop expired sessions and predictions (about once a minute: memory bounded by what the
        age bound keeps)."""
        self._sessions = {k: v for k, v in self._sessions.items() if v[1] > now}
        self._pred = {k: v for k, v in self._pred.items() if v[2] > now}
        self._pfx_prune_at = now + 60.0

    # -------------------------------------------------------------- idempotency
    def _idem_expire(self, now: float) -> None:
        due, idem = self._idem_due, self._idem
        while due and due[0][0] <= now:
            until, key = heapq.heappop(due)
            e = idem.get(key)
            if e is not None and e.until == until:
                del idem[key]

    def claim(self, key: str, ttl_s: float) -> Claim:
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

    def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        if not answer:
            raise ValueError("an idempotent answer must not be empty")
        self._set_idem(key, bytes(answer), self.clock() + ttl_s)

    def abandon(self, key: str) -> None:
        e = self._idem.get(key)
        if e is not None and e.answer is None:
            del self._idem[key]

    # -------------------------------------------------------------- durability
    def restore(self, epoch: Epoch | None, log_id: str,
                events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None) -> dict[str, int]:
        """After a restart (the state has no epoch: ``epoch`` is None), the decision log's events and
        idempotency answers (:meth:`rebuild`, :meth:`restore_answers`); counts of what was replayed."""
        now_wall = time.time() if now_wall is None else now_wall
        out = self.rebuild(events, now_wall)
        out["idempotency_keys"] = self.restore_answers(answers, now_wall)
        return out

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
            elif self._release(ev.reservation_id) is not None:
                out["released"] += 1
        out["expired"] = self._expire(now)
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
                self.complete(key, answer, until - now_wall)
                n += 1
        return n

    def describe(self) -> dict[str, Any]:
        return {"backend": "embedded", "reservations": len(self._held), "pools": len(self._in_flight)}


P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")


def awaited(op: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """The generic async adapter: ``op``, a synchronous core's operation, as a coroutine method of
    a wrapper holding the core in ``self.core``. Awaiting it runs ``op`` at once and never suspends,
    so no other task runs in between (the embedded state keeps its no-await guarantees)."""

    async def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return op(self.core, *args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = op.__name__, op.__qualname__, op.__doc__
    return call


class EmbeddedState:
    """The embedded state (module docstring): :class:`EmbeddedCore` behind ``router.service.ports``
    -- each operation the core's, awaited without suspending. ``core`` is there for what runs in
    this process only: the fail-open wrapper's local view, the tests' inspection."""

    backend = "embedded"
    #: a state in this process never fails
    error: str | None = None

    def __init__(self, alpha: float = STATS_ALPHA, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, record_ttl_s: float = RECORD_S,
                 quota_window_s: float = WINDOW_S, core: EmbeddedCore | None = None):
        self.core = core if core is not None else EmbeddedCore(alpha, clock, wall_clock, record_ttl_s, quota_window_s)
        #: the quota usage read without an await, exact (the decisions' budgets in this process)
        self.quota_reader: Callable[[Sequence[str]], dict[str, QuotaUsage]] | None = self.core.quota_usage

    admit = awaited(EmbeddedCore.admit)
    settle = awaited(EmbeddedCore.settle)
    lookup = awaited(EmbeddedCore.lookup)
    view = awaited(EmbeddedCore.view)
    fairness = awaited(EmbeddedCore.fairness)
    put_session = awaited(EmbeddedCore.put_session)
    report = awaited(EmbeddedCore.report)
    ejections = awaited(EmbeddedCore.ejections)
    claim = awaited(EmbeddedCore.claim)
    complete = awaited(EmbeddedCore.complete)
    abandon = awaited(EmbeddedCore.abandon)
    restore = awaited(EmbeddedCore.restore)

    async def epoch(self) -> Epoch | None:
        """None: a state in this process has no epoch (it is rebuilt from the decision log at start)."""
        return None

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        """Nothing to announce in this process."""

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        """Nothing to announce in this process."""

    async def healthy(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return self.core.describe()

    async def close(self) -> None:
        pass
