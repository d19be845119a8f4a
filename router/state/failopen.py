"""``state_fail_open``: the shared backend while it answers; while it cannot be reached, an embedded
view of this process's own work (:class:`FailOpenState`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from router.state.base import (
    Admission,
    Admitted,
    Affinity,
    Claim,
    Ejection,
    EjectionRule,
    Epoch,
    Released,
    Reserved,
    Settled,
    Settlement,
    StateRestoring,
    StateUnavailable,
    StateView,
)
from router.state.embedded import EmbeddedState
from router.state.ledger import QuotaReserved, QuotaSettled

if TYPE_CHECKING:
    from router.state.redis import RedisState


class FailOpenState:
    """``state_fail_open``: the shared backend while it answers; while it cannot be reached, an
    embedded view of this process's own work (logged once per outage, counted in ``failovers``).
    After a failure the shared backend is tried again ``retry_s`` later, not on every call.

    What failing open means: while the server is away this router admits against its own
    reservations only, so the pools may be overcommitted by the other routers' work; reservations
    the shared backend held expire there on their own hold; those taken locally (pools and quota
    reservations) are released and settled locally. Fail closed (the default:
    :class:`StateUnavailable`, a 503) never overcommits. Recovery (epoch, restore) is the shared
    backend's alone: the local view has no epoch."""

    quota_reader = None
    #: it always answers (class docstring: what that costs), so it is never the reason for a 503
    error: str | None = None

    def __init__(self, primary: RedisState, fallback: EmbeddedState | None = None, retry_s: float = 1.0,
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

    async def admit(self, a: Admission) -> Admitted:
        return await self._call("admit", a)  # type: ignore[no-any-return]

    async def fairness(self, tenants: Sequence[str], lift: Sequence[str] = ()) -> dict[str, float]:
        return await self._call("fairness", tenants, lift)  # type: ignore[no-any-return]

    async def settle(self, s: Settlement) -> Settled:
        """What this process took during an outage (a pool's reservation, a quota reservation) is
        given back or settled here; the rest goes to the shared backend (or, while it is away, here)."""
        local = self.fallback.core.settle(dataclasses.replace(s, outcome=None, cached_tokens=None))
        rest = dataclasses.replace(s, release=s.release and local.pool is None,
                                   quota=None if local.quota else s.quota)
        got: Settled = await self._call("settle", rest)
        return Settled(local.pool or got.pool, local.quota or got.quota, got.retention_pool)

    async def lookup(self, hashes: np.ndarray, session: str | None, ttl_s: float) -> Affinity:
        return await self._call("lookup", hashes, session, ttl_s)  # type: ignore[no-any-return]

    async def view(self, quota_keys: Sequence[str] = (), durations: bool = False) -> StateView:
        return await self._call("view", quota_keys, durations)  # type: ignore[no-any-return]

    async def report(self, outcomes: Sequence[tuple[str, bool]], rule: EjectionRule) -> list[Ejection]:
        return await self._call("report", outcomes, rule)  # type: ignore[no-any-return]

    async def ejections(self, probe: Sequence[str] = (), lease_s: float = 0.0) -> list[Ejection]:
        return await self._call("ejections", probe, lease_s)  # type: ignore[no-any-return]

    async def put_session(self, session_id: str, value: bytes, ttl_s: float) -> None:
        await self._call("put_session", session_id, value, ttl_s)

    async def claim(self, key: str, ttl_s: float) -> Claim:
        return await self._call("claim", key, ttl_s)  # type: ignore[no-any-return]

    async def complete(self, key: str, answer: bytes, ttl_s: float) -> None:
        await self._call("complete", key, answer, ttl_s)

    async def abandon(self, key: str) -> None:
        await self._call("abandon", key)

    async def epoch(self) -> Epoch | None:
        return await self.primary.epoch()  # (the local view has no epoch; an outage raises)

    async def restore(self, epoch: Epoch | None, log_id: str,
                      events: Iterable[Reserved | Released | QuotaReserved | QuotaSettled],
                      answers: Iterable[tuple[str, bytes, float]], now_wall: float | None = None
                      ) -> dict[str, int] | None:
        return await self.primary.restore(epoch, log_id, events, answers, now_wall)

    async def begin_restore(self, epoch: Epoch, log_id: str) -> None:
        await self.primary.begin_restore(epoch, log_id)

    async def end_restore(self, epoch: Epoch, log_id: str, restored: bool) -> None:
        await self.primary.end_restore(epoch, log_id, restored)

    async def healthy(self) -> bool:
        return True  # it always answers (class docstring: what that costs)

    def describe(self) -> dict[str, Any]:
        return {**self.primary.describe(), "fail_open": True, "failovers": self.failovers,
                "answering_locally": self.clock() < self._down_until}

    async def close(self) -> None:
        await self.primary.close()
