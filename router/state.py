"""The router's state besides telemetry, behind one interface (:class:`RouterState`), two backends.

What the decision loop reads and writes:

* **in-flight work per pool** -- :meth:`RouterState.reserve` checks and reserves ``slots`` on the
  first of a ranked list of ``(pool, capacity)`` candidates that has room, in one atomic step;
  :meth:`~RouterState.release` frees it (feedback came, the request failed, or the answer could not
  be sent); a reservation whose release never comes is released after the ``hold_s`` given at
  reserve time (derived from the work's expected time: :func:`hold_for`), and counted per pool
  (:meth:`~RouterState.expired`). The pool key is an opaque string; capacity an int of slots.
* **outcome statistics per pool** -- :meth:`~RouterState.observe` folds one outcome (observed time
  to first token, duration, failure) into an exponentially weighted mean and variance of each
  (:class:`PoolStats`; the estimator below): O(1) memory per pool, whatever the traffic.
* **idempotency keys** -- :meth:`~RouterState.claim` takes a key for ``ttl_s`` or returns what the
  first request with it answered (:class:`Claim`); :meth:`~RouterState.complete` stores that answer,
  :meth:`~RouterState.abandon` drops a claim whose request failed, so a retry decides anew.
* **tenant quotas** -- :meth:`~RouterState.quota_reserve` checks a request against every limit of
  the buckets it counts in (``xroute.schema.quota``) and counts it in all of them, in one atomic
  step; :meth:`~RouterState.quota_settle` reconciles it with its feedback,
  :meth:`~RouterState.quota_release` undoes it (the request was not admitted after all);
  :meth:`~RouterState.quota_usage` reads the buckets (``router.quota_ledger`` holds the arithmetic);
* **prefix affinity and sessions** -- which pool recently received which KV-cache blocks of the
  prompts the router sent (``envs.prefix``: the router's view, an aging record, never the servers'
  real caches): :meth:`~RouterState.prefix_lookup` answers, for a request's block hashes, the
  leading blocks each pool is expected to hold (an :class:`Affinity`, with the pools' retention and
  the pool the request's session last went to); :meth:`~RouterState.prefix_record` records a
  decision's blocks, session and prediction on the pool the reservation took
  (:meth:`~RouterState.reserve_recording`: both in one step -- one round trip on Redis);
  :meth:`~RouterState.prefix_feedback` folds the cached tokens a server reported into the pool's
  retention. Sessions alone: :meth:`~RouterState.get_session`, :meth:`~RouterState.put_session`.
  Every worker and host sharing the state sees the same affinity.

Backends: :class:`EmbeddedState` (the default; in this process, no server; durable through the
decision log -- :meth:`EmbeddedState.rebuild` replays the reservations and releases the log
implies, ``router.backends.decision_events``) and ``router.state_redis.RedisState`` (Redis or Valkey: any
number of router processes and hosts share one view; every operation that must be atomic across
processes is one server-side script). When Redis cannot be reached its operations raise
:class:`StateUnavailable` -- the API's 503 (fail closed, the default); :class:`FailOpenState`
(``state_fail_open``) answers from an embedded view instead while the server is away.

The estimator (both backends, the same arithmetic): for each pool and each measure ``x`` (TTFT ms,
duration ms) with weight ``alpha`` (``state_stats_alpha``, default 0.05: the last ~20 outcomes
carry 64 % of the weight, the half-life is ~13.5 outcomes), the first observation sets
``mean = x, var = 0``; each later one ``d = x - mean; mean += alpha * d;
var = (1 - alpha) * (var + alpha * d * d)`` (the incremental exponentially weighted variance,
Finch 2009). The failure rate is the same mean over 0/1. Counts are kept exactly.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from envs import prefix as px
from router.quota_ledger import RECORD_S, QuotaLedger, QuotaReserved, QuotaSettled, QuotaUsage, QuotaVerdict
from xroute.schema.quota import WINDOW_S, QuotaBucket

#: the default weight of a new outcome in the per-pool statistics (module docstring)
STATS_ALPHA = 0.05
#: :func:`hold_for`'s default: a reservation is held for this many times its expected time ...
HOLD_FACTOR = 2.0
#: ... at least this long (seconds) ...
HOLD_FLOOR_S = 1.0
#: ... and at most this long (seconds)
HOLD_MAX_S = 3600.0


class StateUnavailable(RuntimeError):
    """The shared state's server cannot be reached (or did not answer in time): the router cannot
    tell what the other routers have admitted, so it answers 503 rather than guess (fail closed)."""


class StateRestoring(StateUnavailable):
    """The shared state lost its data (a new :class:`Epoch`) and the routers' decision logs are not
    all back in it yet: an idempotency key it lacks may have been answered before, so a keyed
    request is not decided anew -- the API's 503 with ``Retry-After``, never a second decision. Not
    an outage: a fail-open state does not answer it locally either."""


def hold_for(expected_s: float, factor: float = HOLD_FACTOR, floor_s: float = HOLD_FLOOR_S,
             max_s: float = HOLD_MAX_S) -> float:
    """How long to hold a reservation whose release may never come: ``factor`` times the work's
    expected time (its expected latency: the wait and the service), at least ``floor_s`` and at
    most ``max_s`` seconds."""
    return min(max_s, max(floor_s, factor * max(expected_s, 0.0)))


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool's observed outcomes (exponentially weighted; module docstring) and its work now."""

    pool: str
    outcomes: int = 0
    failures: int = 0
    failure_rate: float | None = None
    ttft_ms_mean: float | None = None
    ttft_ms_std: float | None = None
    duration_ms_mean: float | None = None
    duration_ms_std: float | None = None
    in_flight: int = 0
    expired: int = 0


@dataclass(frozen=True, slots=True)
class Claim:
    """:meth:`RouterState.claim`'s answer: ``"new"`` (the key is the caller's now: decide, then
    :meth:`~RouterState.complete` or :meth:`~RouterState.abandon`), ``"pending"`` (another request
    with the key is being decided: answer 409) or ``"done"`` (``answer`` is the first answer: send
    it again, book nothing)."""

    status: Literal["new", "pending", "done"]
    answer: bytes | None = None


@dataclass(frozen=True, slots=True)
class Epoch:
    """One lifetime of a shared state on its server (:meth:`RouterState.epoch`): ``id`` changes
    when the server lost its data (restarted without persistence, flushed); ``started`` is when
    that lifetime began (wall seconds, the server's clock)."""

    id: str
    started: float


@dataclass(frozen=True, slots=True)
class Affinity:
    """:meth:`RouterState.prefix_lookup`'s answer: per pool with a match, the leading blocks of the
    request's prompt the index expects cached there (``runs``) and the pool's retention (the share
    of the predicted cached tokens its servers confirmed, 1 before any report); the pool the
    request's session last went to within the age bound, or None -- as stored: a committed
    migration's target carries a mark (``router.engine.session_entry`` reads it)."""

    runs: dict[str, int]
    retention: dict[str, float]
    session_pool: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixSend:
    """What a decision records in the prefix index (:meth:`RouterState.prefix_record`): the
    prompt's block hashes, the session key (or None), the age bound (``ttl_s``), and per candidate
    pool (the reservation picks one) its cache capacity in blocks, the cached tokens the view
    predicted there and the seconds until the blocks are expected computed (its expected TTFT)."""

    hashes: np.ndarray
    session: str | None
    ttl_s: float
    candidates: dict[str, tuple[int, float, float]]


@dataclass(frozen=True, slots=True)
class Reserved:
    """A decision log event: ``reservation_id`` took ``slots`` on ``pool`` until ``until`` (wall clock)."""

    reservation_id: str
    pool: str
    until: float
    slots: int = 1


@dataclass(frozen=True, slots=True)
class Released:
    """A decision log event: ``reservation_id``'s work ended (feedback came)."""

    reservation_id: str


class RouterState:
    """The interface (module docstring). Every method may raise :class:`StateUnavailable` in a
    backend with a server."""

    backend = ""
    #: the server's failure as last seen (an operation or :meth:`healthy`; None: it answered), for
    #: ``/readyz`` between two probes; always None for a state in this process
    error: str | None = None
    #: True when the backend also offers the operations as plain calls (``reserve_now``,
    #: ``release_now``, ``claim_now``, ...): the embedded one, whose callers need not await
    sync = False

    # -------------------------------------------------------------- in-flight work
    async def reserve(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                      slots: int = 1) -> str | None:
        """Reserve ``slots`` on the first ``(pool, capacity)`` of ``candidates`` whose in-flight
        work plus ``slots`` stays within its capacity, until :meth:`release` or ``hold_s`` seconds;
        returns that pool, or None when none has room. An id that already holds a reservation
        returns its pool and books nothing (a retry)."""
        raise NotImplementedError

    async def release(self, reservation_id: str) -> str | None:
        """Free a reservation; returns its pool, or None when it was not held (never reserved,
        already released, or expired) -- releasing twice is harmless."""
        raise NotImplementedError

    async def in_flight(self) -> dict[str, int]:
        """Slots reserved now, per pool (pools with none may be absent)."""
        raise NotImplementedError

    async def expire(self) -> int:
        """Release every reservation past its hold now (:meth:`reserve` does it too); returns how many."""
        raise NotImplementedError

    async def expired(self) -> dict[str, int]:
        """Reservations released by expiry since the state began, per pool."""
        raise NotImplementedError

    # -------------------------------------------------------------- outcomes
    async def observe(self, pool: str, ttft_ms: float | None = None, duration_ms: float | None = None,
                      failed: bool = False) -> None:
        """Fold one outcome of work on ``pool`` into its statistics."""
        raise NotImplementedError

    async def stats(self, pool: str) -> PoolStats:
        raise NotImplementedError

    async def durations(self, pools: Sequence[str]) -> dict[str, float]:
        """The observed mean duration (ms) of each of ``pools`` that has one."""
        raise NotImplementedError

    # -------------------------------------------------------------- idempotency
    async def claim(self, key: str, ttl_s: float) -> Claim:
        """Take ``key`` for ``ttl_s`` seconds, or learn who has it (:class:`Claim`). Callers scope
        keys themselves (tenant, route, the client's ``Idempotency-Key``)."""
        raise NotImplementedError

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        """Store the answer of the request that claimed ``key``; retries get it for ``ttl_s``."""
        raise NotImplementedError

    async def abandon(self, key: str) -> None:
        """Drop a claim whose request failed (unless it was completed), so a retry decides anew."""
        raise NotImplementedError

    # -------------------------------------------------------------- a server that lost its data
    async def epoch(self) -> Epoch | None:
        """The shared state's current :class:`Epoch`, begun by this call when the server has none
        (it is new, or lost its data); None for a state that lives in this process (the embedded
        one is rebuilt from the decision log at start instead)."""
        return None

    async def restore(self, epoch: Epoch, log_id: str,
                      events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                      answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None
                      ) -> dict[str, int] | None:
        """Put back into ``epoch`` what the server lost and one decision log knows: the
        reservations of ``events`` whose hold has not passed (released where the log has their
        feedback; capacity is not checked: they were admitted), the tenant quota reservations of
        its quota events (settled where the log has their feedback) and the idempotency ``answers``
        (``(key, answer, until)``, ``until`` wall clock) a key does not already hold. Done once per
        epoch and log (``log_id``): returns counts, or None when another router restored this log
        into this epoch already. Reservations already held are left as they are, so a restore that
        overlaps the live decisions books nothing twice."""
        raise NotImplementedError

    # -------------------------------------------------------------- tenant quotas
    async def quota_reserve(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                            hold_s: float) -> QuotaVerdict:
        """Check one request (``tokens``, ``usd``, one request, one concurrency slot) against every
        limit of ``buckets`` and, when all have room, count it in each -- atomically, across every
        router sharing the state. A refusal names the first limit hit (:class:`QuotaVerdict`). An
        id that holds a reservation already is admitted and books nothing (a retry). The
        concurrency slot is held until :meth:`quota_settle`, :meth:`quota_release` or ``hold_s``."""
        raise NotImplementedError

    async def reserve_with_quota(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                                 buckets: Sequence[QuotaBucket], tokens: int, usd: float
                                 ) -> tuple[str | BaseException | None, QuotaVerdict | BaseException]:
        """:meth:`reserve` and :meth:`quota_reserve` of one request at once (a shared server gets
        both in one round trip). Each result, or the exception its call raised: the caller gives
        back whichever succeeded when the other did not."""
        out: list[Any] = []
        for call in (lambda: self.reserve(candidates, reservation_id, hold_s),
                     lambda: self.quota_reserve(reservation_id, buckets, tokens, usd, hold_s)):
            try:
                out.append(await call())
            except Exception as e:
                out.append(e)
        return out[0], out[1]

    async def quota_settle(self, reservation_id: str, tokens: int | None, usd: float | None) -> bool:
        """The reservation's feedback: its concurrency slot is freed and what it counts becomes
        ``tokens`` (while in the sliding window) and ``usd`` (in its day); None keeps what was
        reserved. Once per reservation; False when none is held."""
        raise NotImplementedError

    async def quota_release(self, reservation_id: str) -> bool:
        """Undo a reservation entirely (its request was not admitted after all); False when none is held."""
        raise NotImplementedError

    async def quota_usage(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        """What each bucket of ``keys`` holds now (zeros for one never used)."""
        raise NotImplementedError

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        """Say, before reading the decision log ``log_id``, that this router is restoring it into
        ``epoch``: until :meth:`end_restore` (or a deadline, should this router die), no router
        decides a keyed request whose key the state lacks (:class:`StateRestoring`). Nothing to say
        for a state in this process."""

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        """The restore :meth:`begin_restore` announced is over; ``restored``: this router's part in
        ``epoch`` is done (its log is back, or had nothing the epoch lacked), so keyed requests may
        be decided here once every other restore has ended."""

    # -------------------------------------------------------------- prefix affinity and sessions
    async def prefix_lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        """The pools expected to hold the leading blocks of ``hashes`` (int64, prompt order) now,
        by the index's record (module docstring; ``envs.prefix.view_lookup``: an entry counts
        once its blocks are expected computed, within ``ttl_s``, and while fewer than the pool's
        capacity of blocks were sent there after it), and where ``session`` last went."""
        raise NotImplementedError

    async def prefix_record(self, decision_id: str, pool: str, send: PrefixSend) -> None:
        """The decision ``decision_id`` sent ``send.hashes`` (and its session) to ``pool``, one of
        ``send.candidates``; the prediction is kept for :meth:`prefix_feedback` for ``send.ttl_s``."""
        raise NotImplementedError

    async def reserve_recording(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                                send: PrefixSend, slots: int = 1) -> str | None:
        """:meth:`reserve`, then :meth:`prefix_record` on the pool reserved (nothing when none had
        room) -- in one round trip where the backend has a server."""
        pool = await self.reserve(candidates, reservation_id, hold_s, slots)
        if pool is not None:
            await self.prefix_record(reservation_id, pool, send)
        return pool

    async def prefix_feedback(self, decision_id: str, cached_tokens: float, alpha: float) -> str | None:
        """A server reported ``cached_tokens`` of the decision's prompt cached: the pool's retention
        learns it (``envs.prefix.retention_update``, weight ``alpha``) once per decision. Returns the
        pool, or None when the decision recorded no prediction (or it expired, or was used)."""
        raise NotImplementedError

    async def get_session(self, session_id: str) -> bytes | None:
        """The value stored for ``session_id`` (the pool its last request went to), or None."""
        raise NotImplementedError

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        raise NotImplementedError

    # -------------------------------------------------------------- life
    async def healthy(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        """What ``/v1/admin/status`` shows (never a credential)."""
        return {"backend": self.backend}

    async def close(self) -> None:
        pass


def _ewm(n: int, mean: float, var: float, x: float, alpha: float) -> tuple[float, float]:
    """One step of the exponentially weighted mean and variance (module docstring)."""
    if n == 0:
        return x, 0.0
    d = x - mean
    return mean + alpha * d, (1.0 - alpha) * (var + alpha * d * d)


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


def _finite(x: float | None, name: str) -> float | None:
    if x is not None and not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return x


def _check_reserve(candidates: Sequence[tuple[str, int]], hold_s: float, slots: int) -> None:
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if not (hold_s > 0 and math.isfinite(hold_s)):
        raise ValueError(f"hold_s must be a positive number of seconds, got {hold_s!r}")
    for pool, capacity in candidates:
        if not isinstance(pool, str) or int(capacity) != capacity:
            raise ValueError(f"candidates must be (pool: str, capacity: int) pairs, got {(pool, capacity)!r}")


class EmbeddedState(RouterState):
    """The state in this process (no server): dictionaries, and heaps of deadlines expired lazily.

    Durable through the decision log: after a restart, :meth:`rebuild` replays the log's events
    (``router.backends.decision_events``). ``clock`` is monotonic seconds (``time.monotonic``)."""

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


class FailOpenState(RouterState):
    """``state_fail_open``: the shared backend while it answers; while it cannot be reached, an
    embedded view of this process's own work (logged once per outage, counted in ``failovers``).
    After a failure the shared backend is tried again ``retry_s`` later, not on every call.

    What failing open means: while the server is away this router admits against its own
    reservations only, so the pools may be overcommitted by the other routers' work; reservations
    the shared backend held expire there on their own hold; those taken locally are released
    locally. Fail closed (the default: :class:`StateUnavailable`, a 503) never overcommits."""

    def __init__(self, primary: RouterState, fallback: EmbeddedState | None = None, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, on_failover: Callable[[str], None] | None = None):
        self.primary = primary
        self.fallback = fallback if fallback is not None else EmbeddedState()
        self.backend = f"{primary.backend}+fail-open"
        self.retry_s, self.clock, self.on_failover = retry_s, clock, on_failover
        self._down_until = -math.inf
        self.failovers = 0

    async def _call(self, name: str, *args: Any) -> Any:
        if self.clock() >= self._down_until:
            try:
                result = await getattr(self.primary, name)(*args)
            except StateRestoring:  # the server answers: not an outage to answer locally
                raise
            except StateUnavailable as e:
                if self._down_until == -math.inf or self.clock() - self._down_until > self.retry_s:
                    self.failovers += 1
                    if self.on_failover is not None:
                        self.on_failover(str(e))
                self._down_until = self.clock() + self.retry_s
            else:
                self._down_until = -math.inf
                return result
        return await getattr(self.fallback, name)(*args)

    async def reserve(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                      slots: int = 1) -> str | None:
        return await self._call("reserve", candidates, reservation_id, hold_s, slots)  # type: ignore[no-any-return]

    async def release(self, reservation_id: str) -> str | None:
        local = self.fallback.release_now(reservation_id)  # taken during an outage: released here
        return local if local is not None else await self._call("release", reservation_id)  # type: ignore[no-any-return]

    async def in_flight(self) -> dict[str, int]:
        return await self._call("in_flight")  # type: ignore[no-any-return]

    async def expire(self) -> int:
        return await self._call("expire")  # type: ignore[no-any-return]

    async def expired(self) -> dict[str, int]:
        return await self._call("expired")  # type: ignore[no-any-return]

    async def observe(self, pool: str, ttft_ms: float | None = None, duration_ms: float | None = None,
                      failed: bool = False) -> None:
        await self._call("observe", pool, ttft_ms, duration_ms, failed)

    async def stats(self, pool: str) -> PoolStats:
        return await self._call("stats", pool)  # type: ignore[no-any-return]

    async def durations(self, pools: Sequence[str]) -> dict[str, float]:
        return await self._call("durations", pools)  # type: ignore[no-any-return]

    async def claim(self, key: str, ttl_s: float) -> Claim:
        return await self._call("claim", key, ttl_s)  # type: ignore[no-any-return]

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        await self._call("complete", key, answer, ttl_s)

    async def abandon(self, key: str) -> None:
        await self._call("abandon", key)

    async def quota_reserve(self, reservation_id: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                            hold_s: float) -> QuotaVerdict:
        return await self._call("quota_reserve", reservation_id, buckets, tokens, usd, hold_s)  # type: ignore[no-any-return]

    async def reserve_with_quota(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                                 buckets: Sequence[QuotaBucket], tokens: int, usd: float
                                 ) -> tuple[str | BaseException | None, QuotaVerdict | BaseException]:
        # one call after the other, each failing over on its own (the local view answers in an outage)
        return await RouterState.reserve_with_quota(self, candidates, reservation_id, hold_s, buckets, tokens, usd)

    async def quota_settle(self, reservation_id: str, tokens: int | None, usd: float | None) -> bool:
        if self.fallback.quota_settle_now(reservation_id, tokens, usd):  # reserved during an outage: here
            return True
        return await self._call("quota_settle", reservation_id, tokens, usd)  # type: ignore[no-any-return]

    async def quota_release(self, reservation_id: str) -> bool:
        if self.fallback.quota_release_now(reservation_id):
            return True
        return await self._call("quota_release", reservation_id)  # type: ignore[no-any-return]

    async def quota_usage(self, keys: Sequence[str]) -> dict[str, QuotaUsage]:
        return await self._call("quota_usage", keys)  # type: ignore[no-any-return]
    async def prefix_lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        return await self._call("prefix_lookup", hashes, session, ttl_s)  # type: ignore[no-any-return]

    async def prefix_record(self, decision_id: str, pool: str, send: PrefixSend) -> None:
        await self._call("prefix_record", decision_id, pool, send)

    async def reserve_recording(self, candidates: Sequence[tuple[str, int]], reservation_id: str, hold_s: float,
                                send: PrefixSend, slots: int = 1) -> str | None:
        return await self._call("reserve_recording", candidates, reservation_id, hold_s, send,  # type: ignore[no-any-return]
                                slots)

    async def prefix_feedback(self, decision_id: str, cached_tokens: float, alpha: float) -> str | None:
        return await self._call("prefix_feedback", decision_id, cached_tokens, alpha)  # type: ignore[no-any-return]

    async def get_session(self, session_id: str) -> bytes | None:
        return await self._call("get_session", session_id)  # type: ignore[no-any-return]

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        await self._call("put_session", session_id, value, ttl_s)

    async def epoch(self) -> Epoch | None:
        return await self.primary.epoch()  # (the local view has no epoch; an outage raises)

    async def restore(self, epoch: Epoch, log_id: str,
                      events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                      answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None
                      ) -> dict[str, int] | None:
        return await self.primary.restore(epoch, log_id, events, answers, now_wall)

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        await self.primary.begin_restore(epoch, log_id)

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        await self.primary.end_restore(epoch, log_id, restored)

    async def healthy(self) -> bool:
        return True  # it always answers (module docstring: what that costs)

    def describe(self) -> dict[str, Any]:
        return {**self.primary.describe(), "fail_open": True, "failovers": self.failovers,
                "answering_locally": self.clock() < self._down_until}

    async def close(self) -> None:
        await self.primary.close()


def pool_key(model: str, offering_id: str) -> str:
    """The state's key of a pool: the (model, offering) pair (``docs/env.md``, "Pools")."""
    return f"{model}|{offering_id}"
