"""Test helpers over the shared state's protocol operations (``router.service.ports``; no tests
here): the old single-purpose operations the suite still speaks -- reserve, release, a quota
reservation, statistics -- each written as the ``admit``/``settle``/``view``/``lookup`` a router
makes, so every test exercises the production operations on whichever backend; the one decision
of the service pipeline in this process (:func:`decide`, what ``RoutingEngine.decide`` was); and
what only tests read (a pool's statistics)."""

from __future__ import annotations

import math
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from router.decision.engine import RoutingEngine
from router.service.admission import decide as service_decide
from router.service.ports import SharedState
from router.state.base import (
    QUOTA_UNDO,
    Admission,
    PoolOutcome,
    PrefixSend,
    QuotaCharge,
    QuotaSettle,
    Settlement,
)
from router.state.embedded import EmbeddedState
from router.state.ledger import QuotaUsage, QuotaVerdict
from router.state.redis import RedisState
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest
from xroute.schema.quota import QuotaBucket

T = TypeVar("T")

#: the pool the quota helpers admit on (room for everything: only the quotas can refuse)
QUOTA_POOL = ("quota-pool", 10**9)


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (an operation of the embedded state, or a decision on
    it) to its end, here and now, without an event loop."""
    try:
        coro.send(None)
    except StopIteration as e:
        return e.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("the coroutine suspended: not a state in this process")


def decide(engine: RoutingEngine, req: RouteRequest, who: Principal, decision_id: str, wall: float,
           state: EmbeddedState | None = None) -> tuple[bytes, tuple[Any, ...], str, dict[str, Any]]:
    """One decision as the service pipeline makes it (``router.service.admission.decide``: lookup,
    rank, one admission of the pool, the quotas and the prefix, the engine's admission) on an
    embedded ``state`` -- (answer JSON, decision-log row, offering id, policy info), the row not
    logged. Without ``state``, the engine alone: ranked and admitted to its first candidate, nothing
    reserved (the environment's view alone, as a router without a shared state would)."""
    if state is None:
        r = engine.rank(req, who, decision_id, wall)
        return engine.admit(r, 0)
    d = run_now(service_decide(engine, state, req, who, decision_id, wall))
    return d.payload, d.row, d.offering_id, d.pinfo


# ---------------------------------------------------------------------------------------- reservations
async def reserve(s: SharedState, candidates: Sequence[tuple[str, int]], rid: str, hold_s: float,
                  slots: int = 1) -> str | None:
    """An admission without quota or prefix: the pool, or None."""
    return (await s.admit(Admission(rid, candidates, hold_s, slots=slots))).pool


async def release(s: SharedState, rid: str) -> str | None:
    """A settlement that only releases: the pool, or None when not held."""
    return (await s.settle(Settlement(rid))).pool


async def in_flight(s: SharedState) -> dict[str, int]:
    return (await s.view()).in_flight


async def expired(s: SharedState) -> dict[str, int]:
    return (await s.view()).expired


async def observe(s: SharedState, pool: str, ttft_ms: float | None = None, duration_ms: float | None = None,
                  failed: bool = False) -> None:
    """A settlement that only folds an outcome into the pool's statistics."""
    await s.settle(Settlement("", release=False, outcome=PoolOutcome(pool, ttft_ms, duration_ms, failed)))


# ---------------------------------------------------------------------------------------- quotas
async def quota_reserve(s: SharedState, rid: str, buckets: Sequence[QuotaBucket], tokens: int, usd: float,
                        hold_s: float) -> QuotaVerdict:
    """An admission on :data:`QUOTA_POOL` with a quota charge: its verdict."""
    got = await s.admit(Admission(rid, [QUOTA_POOL], hold_s, QuotaCharge(buckets, tokens, usd)))
    return got.refused if got.refused is not None else QuotaVerdict(True)


async def quota_settle(s: SharedState, rid: str, tokens: int | None, usd: float | None) -> bool:
    """A settlement that only reconciles the quota reservation."""
    return (await s.settle(Settlement(rid, release=False, quota=QuotaSettle(tokens, usd)))).quota


async def quota_release(s: SharedState, rid: str) -> bool:
    """The undo of a quota admission: its pool and its quota reservation."""
    return (await s.settle(Settlement(rid, quota=QUOTA_UNDO))).quota


async def quota_usage(s: SharedState, keys: Sequence[str]) -> dict[str, QuotaUsage]:
    return (await s.view(keys)).quotas


# ---------------------------------------------------------------------------------------- prefix, sessions
async def reserve_recording(s: SharedState, candidates: Sequence[tuple[str, int]], rid: str, hold_s: float,
                            send: PrefixSend) -> str | None:
    """An admission with a prefix record: the pool."""
    return (await s.admit(Admission(rid, candidates, hold_s, prefix=send))).pool


async def prefix_feedback(s: SharedState, rid: str, cached_tokens: float, alpha: float) -> str | None:
    """A settlement that only teaches the prefix retention: the pool that learned, or None."""
    got = await s.settle(Settlement(rid, release=False, cached_tokens=cached_tokens, retention_alpha=alpha))
    return got.retention_pool


async def get_session(s: SharedState, session: str) -> bytes | None:
    """Where ``session`` last went (a lookup without blocks)."""
    got = (await s.lookup(np.zeros(0, dtype=np.int64), session, 600.0)).session_pool
    return None if got is None else got.encode()


# ---------------------------------------------------------------------------------------- what only tests read
@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool's observed outcomes (``router.state.base``'s estimator) and its work now."""

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


def _f(x: Any) -> float | None:
    return None if x is None else float(x)


async def stats(s: SharedState, pool: str) -> PoolStats:
    """A pool's statistics as the backend holds them: the embedded core's, or the Redis hash
    ``stats:<pool>`` read directly."""
    view = await s.view()
    if isinstance(s, EmbeddedState):
        return core_stats(s, pool)
    assert isinstance(s, RedisState)
    h = await s._r.hgetall(s.base + "stats:" + pool)
    h = {k.decode(): v for k, v in h.items()}
    n, tn, dn = int(h.get("outcomes", 0)), int(h.get("ttft_n", 0)), int(h.get("dur_n", 0))
    vt, vd = _f(h.get("ttft_var")), _f(h.get("dur_var"))
    return PoolStats(pool, n, int(h.get("failures", 0)), _f(h.get("failure_rate")) if n else None,
                     _f(h.get("ttft_mean")) if tn else None, math.sqrt(max(vt or 0.0, 0.0)) if tn else None,
                     _f(h.get("dur_mean")) if dn else None, math.sqrt(max(vd or 0.0, 0.0)) if dn else None,
                     view.in_flight.get(pool, 0), view.expired.get(pool, 0))


def core_stats(s: EmbeddedState, pool: str) -> PoolStats:
    """A pool's statistics in an embedded state, read without an await."""
    view = s.core.view()
    st = s.core.stats.get(pool)
    if st is None:
        return PoolStats(pool, in_flight=view.in_flight.get(pool, 0), expired=view.expired.get(pool, 0))
    return PoolStats(pool, st.outcomes, st.failures, st.failure_rate if st.outcomes else None,
                     st.ttft_mean if st.ttft_n else None, math.sqrt(st.ttft_var) if st.ttft_n else None,
                     st.dur_mean if st.dur_n else None, math.sqrt(st.dur_var) if st.dur_n else None,
                     view.in_flight.get(pool, 0), view.expired.get(pool, 0))
