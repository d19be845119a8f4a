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
  :meth:`~RouterState.quota_usage` reads the buckets (``router.state.ledger`` holds the arithmetic);
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
implies, ``router.store.readers.decision_events``) and ``router.state.redis.RedisState`` (Redis or Valkey: any
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

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from router.core.settings import HOLD_FACTOR, HOLD_FLOOR_S, HOLD_MAX_S
from router.state.ledger import (
    QuotaReserved,
    QuotaSettled,
    QuotaUsage,
    QuotaVerdict,
)
from xroute.schema.quota import QuotaBucket


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
    migration's target carries a mark (``router.decision.engine.session_entry`` reads it)."""

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


def pool_key(model: str, offering_id: str) -> str:
    """The state's key of a pool: the (model, offering) pair (``docs/env.md``, "Pools")."""
    return f"{model}|{offering_id}"
