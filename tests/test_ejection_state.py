"""Outlier ejection in the shared state (``router.service.ports.Ejections``): the same arithmetic on
the embedded state and on a real redis-server (``router.state.base.ejection_step`` and
``lua/lib/eject.lua``), step by step through every branch -- counting, ejection, a straggler while
ejected, half-open, one probe at a time, a failed probe doubling the interval up to the cap, a
successful probe bringing the target back, the doubling starting again after the target was back
for the cap -- and one Redis shared by two clients seeing one ejection."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

import pytest

from router.state.base import Ejection, EjectionRule
from router.state.embedded import EmbeddedState
from router.state.redis import RedisState

_prefixes = (f"ej{i}-{time.time_ns()}" for i in itertools.count())
RULE = EjectionRule(after=2, base_s=0.2, max_s=0.8)
LEASE = 0.3


def _key(e: Ejection) -> tuple[Any, ...]:
    return (e.target, e.failures, e.ejections, e.left_s is None, e.probe, e.ejected_now)


def _same(a: list[Ejection], b: list[Ejection]) -> None:
    a, b = sorted(a, key=lambda e: e.target), sorted(b, key=lambda e: e.target)
    assert [_key(x) for x in a] == [_key(y) for y in b]
    for x, y in zip(a, b):
        if x.left_s is not None and y.left_s is not None:
            assert abs(x.left_s - y.left_s) < 0.05, (x, y)


#: (seconds to wait first, operation, its arguments, what the embedded state must answer: per target
#: (failures, ejections, ejected, probe, ejected_now))
SCENARIO: list[tuple[float, str, Any, list[tuple[str, int, int, bool, bool, bool]]]] = [
    (0, "report", [("A", True)], [("A", 1, 0, False, False, False)]),
    (0, "report", [("A", True), ("A", False)], [("A", 0, 1, True, False, True), ("A", 0, 1, True, False, False)]),
    (0, "read", ["A"], [("A", 0, 1, True, False, False)]),  # ejected: no probe yet
    (0.3, "read", ["B"], [("A", 0, 1, True, False, False)]),  # half-open, but not the caller's to probe
    (0, "read", ["A"], [("A", 0, 1, True, True, False)]),  # the probe: this caller's
    (0, "read", ["A"], [("A", 0, 1, True, False, False)]),  # held: nobody else's
    (0, "report", [("A", True)], [("A", 0, 2, True, False, True)]),  # the probe failed: 0.4 s
    (0.25, "read", ["A"], [("A", 0, 2, True, False, False)]),  # still ejected (doubled)
    (0.25, "read", ["A"], [("A", 0, 2, True, True, False)]),
    (0, "report", [("A", False), ("B", True), ("B", False)], [("A", 0, 2, False, False, False),
                                                               ("B", 1, 0, False, False, False),
                                                               ("B", 0, 0, False, False, False)]),
    (0, "read", [], []),  # nothing failing
    (0, "report", [("A", True), ("A", True)], [("A", 1, 2, False, False, False), ("A", 0, 3, True, False, True)]),
    (0.5, "read", ["A"], [("A", 0, 3, True, False, False)]),  # 0.8 s (0.2 * 4, the cap): not yet
    (0.4, "read", ["A"], [("A", 0, 3, True, True, False)]),
    (0, "report", [("A", False)], [("A", 0, 3, False, False, False)]),
    (0.9, "report", [("A", True), ("A", True)], [("A", 1, 3, False, False, False), ("A", 0, 4, True, False, True)]),
    (0.3, "read", ["A"], [("A", 0, 4, True, True, False)]),  # back for the cap: the base interval again
]


def test_ejection_arithmetic_is_the_same_on_both_backends(redis_server: Any) -> None:
    async def main() -> None:
        emb = EmbeddedState()
        red = RedisState(redis_server.url, prefix=next(_prefixes))
        try:
            for i, (wait, op, args, want) in enumerate(SCENARIO):
                await asyncio.sleep(wait)
                if op == "report":
                    a, b = await emb.report(args, RULE), await red.report(args, RULE)
                else:
                    a, b = await emb.ejections(args, LEASE), await red.ejections(args, LEASE)
                got = [(e.target, e.failures, e.ejections, e.left_s is not None, e.probe, e.ejected_now) for e in a]
                assert got == want, (i, got)
                _same(a, b)
                for e in a:
                    if e.ejected_now:  # the interval: base * 2**streak, at most the cap
                        assert e.left_s is not None and 0.15 < e.left_s <= RULE.max_s
            # a random burst (no waits): counting and ejection alike
            rng = random.Random(7)
            for _ in range(200):
                batch = [(rng.choice("CDE"), rng.random() < 0.7) for _ in range(rng.randint(1, 4))]
                _same(await emb.report(batch, RULE), await red.report(batch, RULE))
            _same(await emb.ejections(["C", "D"], LEASE), await red.ejections(["C", "D"], LEASE))
        finally:
            await red.close()

    asyncio.run(main())


def test_two_clients_of_one_redis_see_one_ejection_and_one_probe(redis_server: Any) -> None:
    async def main() -> None:
        prefix = next(_prefixes)
        a, b = RedisState(redis_server.url, prefix=prefix), RedisState(redis_server.url, prefix=prefix)
        try:
            await a.report([("pool:m|x", True)], RULE)
            got = await b.report([("pool:m|x", True)], RULE)  # consecutive across the two
            assert got[0].ejected_now
            seen = await a.ejections([], LEASE)
            assert [(e.target, e.left_s is not None) for e in seen] == [("pool:m|x", True)]
            await asyncio.sleep(0.25)
            one, two = await asyncio.gather(a.ejections(["pool:m|x"], LEASE), b.ejections(["pool:m|x"], LEASE))
            assert [e.probe for e in one + two].count(True) == 1  # one probe between them
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_bad_rule_is_refused_by_both_backends(redis_server: Any) -> None:
    async def main() -> None:
        red = RedisState(redis_server.url, prefix=next(_prefixes))
        try:
            for s in (EmbeddedState(), red):
                with pytest.raises(ValueError, match="after"):
                    await s.report([("x", True)], EjectionRule(0, 1.0, 2.0))
                with pytest.raises(ValueError, match="base_s"):
                    await s.report([("x", True)], EjectionRule(1, 3.0, 2.0))
        finally:
            await red.close()

    asyncio.run(main())
