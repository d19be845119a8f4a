"""``state_fail_open``: the shared backend while it answers; while it cannot be reached, an embedded
view of this process's own work (:class:`FailOpenState`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

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
)
from router.state.embedded import EmbeddedState
from router.state.ledger import (
    QuotaReserved,
    QuotaSettled,
    QuotaUsage,
    QuotaVerdict,
)
from xroute.schema.quota import QuotaBucket


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
