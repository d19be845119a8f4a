"""The router's state (``router/state/base.py``, ``router/state/redis.py``): one suite run against both
backends -- the embedded one and a real redis-server (``tests/servers.py``) -- then the embedded
backend rebuilt from a real SQLite decision log, the Redis backend with its server stopped (fail
closed, and fail open), and OS processes hammering one Redis without ever admitting more than a
pool's capacity."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio

from router.decision.engine import RoutingEngine
from router.service.ports import SharedState
from router.state.base import (
    QUOTA_UNDO,
    Admission,
    Claim,
    PoolOutcome,
    PrefixSend,
    QuotaCharge,
    QuotaSettle,
    Released,
    Reserved,
    Settlement,
    StateRestoring,
    StateUnavailable,
    hold_for,
    pool_key,
)
from router.state.embedded import EmbeddedState
from router.state.failopen import FailOpenState
from router.state.open import StateSettings, open_state
from router.state.redis import RedisState, redact
from router.store.readers import decision_events
from router.store.rows import DecisionRow
from router.store.sqlite import DecisionStore
from tests.servers import RedisServer
from tests.state_support import decide, expired, get_session, in_flight, observe, release, reserve, stats
from tests.test_router_support import ROUTE, make_setup
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest
from xroute.schema.quota import QuotaBucket, TenantQuotas, buckets_for

_prefixes = (f"t{i}-{time.time_ns()}" for i in itertools.count())
Make = Callable[[], SharedState]


@pytest.fixture(params=["embedded", "redis"])
def make_state(request: pytest.FixtureRequest) -> Make:
    """A factory (called inside the test's event loop) of a fresh, empty state of each backend."""
    if request.param == "embedded":
        return EmbeddedState
    url = request.getfixturevalue("redis_server").url
    prefix = next(_prefixes)  # every test its own keys on the shared server
    return lambda: RedisState(url, prefix=prefix)


def _run(make: Make, body: Callable[[SharedState], Awaitable[None]]) -> None:
    async def main() -> None:
        state = make()
        try:
            await body(state)
        finally:
            await state.close()

    asyncio.run(main())


def test_check_and_reserve_release_and_retries(make_state: Make) -> None:
    async def body(s: SharedState) -> None:
        cands = [("pool a", 2), ("pool:b", 1)]  # opaque keys: spaces and colons are fine
        got = [await reserve(s, cands, f"r{i}", 60) for i in range(4)]
        assert got == ["pool a", "pool a", "pool:b", None]
        assert await in_flight(s) == {"pool a": 2, "pool:b": 1}
        assert await reserve(s, cands, "r0", 60) == "pool a"  # a retry: its pool, nothing booked
        assert await in_flight(s) == {"pool a": 2, "pool:b": 1}
        assert await release(s, "r1") == "pool a"
        assert await release(s, "r1") is None and await release(s, "never") is None
        assert await reserve(s, cands, "r3", 60) == "pool a"
        # several slots at once, within capacity only
        assert await reserve(s, [("big", 3)], "w1", 60, slots=2) == "big"
        assert await reserve(s, [("big", 3)], "w2", 60, slots=2) is None
        assert await reserve(s, [("big", 3)], "w3", 60, slots=1) == "big"
        assert (await in_flight(s))["big"] == 3
        assert await reserve(s, [("zero", 0)], "z", 60) is None
        assert await expired(s) == {} or set((await expired(s)).values()) == {0}
        for bad in (dict(slots=0), dict(hold_s=0.0), dict(hold_s=math.inf)):
            with pytest.raises(ValueError):
                await reserve(s, [("p", 1)], "bad", **{"hold_s": 1.0, **bad})  # type: ignore[arg-type]

    _run(make_state, body)


def test_concurrent_calls_of_one_iteration_each_get_their_own_answer(make_state: Make) -> None:
    """Calls made together (the Redis backend sends one event-loop iteration's calls as one
    pipeline) are each checked against what the ones before them reserved; a reservation whose
    caller is cancelled before the answer comes is not left held."""

    async def body(s: SharedState) -> None:
        got = await asyncio.gather(*(reserve(s, [("p", 20), ("q", 5)], f"c{i}", 60) for i in range(30)))
        assert got.count("p") == 20 and got.count("q") == 5 and got.count(None) == 5
        assert got[:20] == ["p"] * 20  # in the order they were made
        released = await asyncio.gather(*(release(s, f"c{i}") for i in range(30)))
        assert released == got and await in_flight(s) == {}
        task = asyncio.ensure_future(reserve(s, [("p", 20)], "gone", 60))
        await asyncio.sleep(0)  # queued (or, embedded, already done)
        task.cancel()
        await asyncio.sleep(0.2)
        # (in process the reservation was made before the cancel could come: the caller's to release)
        assert await in_flight(s) == ({"p": 1} if isinstance(s, EmbeddedState) else {})

    _run(make_state, body)


def test_reservations_whose_release_never_comes_expire_and_are_counted(make_state: Make) -> None:
    async def body(s: SharedState) -> None:
        assert await reserve(s, [("p", 1)], "lost", 0.2) == "p"
        assert await reserve(s, [("p", 2)], "kept", 60) == "p"
        assert await reserve(s, [("p", 2)], "released", 0.2) is None  # full: 2 slots held
        assert await release(s, "kept") == "p"
        assert await reserve(s, [("p", 2)], "released", 0.2) == "p"
        assert await release(s, "released") == "p"  # released in time: not counted as expired
        await asyncio.sleep(0.35)
        assert await in_flight(s) == {}
        assert await expired(s) == {"p": 1}
        assert await release(s, "lost") is None  # too late: already expired
        assert await reserve(s, [("p", 1)], "next", 60) == "p"  # the slot is free again
        st = await stats(s, "p")
        assert (st.in_flight, st.expired) == (1, 1)

    _run(make_state, body)


def _reference(alpha: float, xs: list[float]) -> tuple[float, float]:
    mean = var = 0.0
    for i, x in enumerate(xs):
        if i == 0:
            mean, var = x, 0.0
        else:
            d = x - mean
            mean, var = mean + alpha * d, (1 - alpha) * (var + alpha * d * d)
    return mean, math.sqrt(var)


def test_outcome_statistics_follow_the_documented_estimator(make_state: Make) -> None:
    ttft = [120.0, 80.0, 300.0, 95.5, 101.0, 99.0]
    dur = [2000.0, 1500.0, 4100.0, 1800.0]
    fails = [False, False, True, False, False, True]

    async def body(s: SharedState) -> None:
        empty = await stats(s, "gpu")
        assert (empty.outcomes, empty.ttft_ms_mean, empty.failure_rate) == (0, None, None)
        for i, (t, f) in enumerate(zip(ttft, fails)):
            await observe(s, "gpu", ttft_ms=t, duration_ms=dur[i] if i < len(dur) else None, failed=f)
        st = await stats(s, "gpu")
        assert (st.pool, st.outcomes, st.failures) == ("gpu", 6, 2)
        m, sd = _reference(0.05, ttft)
        assert st.ttft_ms_mean == pytest.approx(m, rel=1e-12) and st.ttft_ms_std == pytest.approx(sd, rel=1e-9)
        m, sd = _reference(0.05, dur)
        assert st.duration_ms_mean == pytest.approx(m, rel=1e-12) and st.duration_ms_std == pytest.approx(sd, rel=1e-9)
        assert st.failure_rate == pytest.approx(_reference(0.05, [float(f) for f in fails])[0], rel=1e-12)
        assert (await stats(s, "other")).outcomes == 0  # per pool
        with pytest.raises(ValueError):
            await observe(s, "gpu", ttft_ms=math.nan)

    _run(make_state, body)


def test_idempotency_keys_first_answer_wins(make_state: Make) -> None:
    async def body(s: SharedState) -> None:
        assert await s.claim("a:route:k1", 60) == Claim("new")
        assert await s.claim("a:route:k1", 60) == Claim("pending")  # a concurrent retry
        await s.complete("a:route:k1", b'{"decision_id":"d_1"}', 60)
        assert await s.claim("a:route:k1", 60) == Claim("done", b'{"decision_id":"d_1"}')
        await s.abandon("a:route:k1")  # completed: stays
        assert (await s.claim("a:route:k1", 60)).answer == b'{"decision_id":"d_1"}'
        assert await s.claim("a:route:k2", 60) == Claim("new")
        await s.abandon("a:route:k2")  # the request failed: a retry decides anew
        assert await s.claim("a:route:k2", 60) == Claim("new")
        assert await s.claim("short", 0.2) == Claim("new")
        await asyncio.sleep(0.3)
        assert await s.claim("short", 0.2) == Claim("new")  # its TTL passed
        with pytest.raises(ValueError):
            await s.complete("x", b"", 60)

    _run(make_state, body)


def test_sessions_expire(make_state: Make) -> None:
    async def body(s: SharedState) -> None:
        assert await get_session(s, "a:s") is None
        await s.put_session("a:s", b"m|pool", 0.3)
        assert await get_session(s, "a:s") == b"m|pool" and await get_session(s, "b:s") is None
        await asyncio.sleep(0.4)
        assert await get_session(s, "a:s") is None  # its TTL passed
        assert await s.healthy()
        assert s.describe()["backend"] in ("embedded", "redis")

    _run(make_state, body)


def _id_at(t: float, i: int) -> str:
    """A decision id as ``router.core.logs.new_sorted_id`` makes them at wall time ``t``."""
    return f"d_{int(t * 1000):012x}{i:020x}"


def test_the_embedded_state_is_rebuilt_from_the_sqlite_decision_log(tmp_path: Path) -> None:
    """Decisions reserve, feedback releases: after a restart, replaying the log's events gives the
    in-flight work the router had, and a decision whose hold has passed is expired and counted.
    Rows carry their pool and hold's end; rows of a log written before those columns get them
    derived (the pool from model and offering, the hold from the expected latency)."""
    engine = RoutingEngine(make_setup(tmp_path / "setup").settings)
    who = Principal("a", "tenant", "k")
    req = RouteRequest.model_validate({**ROUTE, "max_output_tokens": 5})
    now = time.time()
    db = tmp_path / "d.db"
    book = EmbeddedState()  # the state the router had (rows 0-4 reserved in it; 5-9 as an older router wrote them)

    async def write() -> list[DecisionRow]:
        log = DecisionStore(db)
        log.start()
        rows = []
        for i in range(10):
            t = now - 30 + i
            row = decide(engine, req, who, _id_at(t, i), t, state=book if i < 5 else None)[1]
            if i < 5:
                assert row.pool == book.core._held[row.decision_id][0] and row.hold_until > t  # type: ignore[operator]
                row = dataclasses.replace(row, hold_until=now + 600)  # a long hold
            else:
                assert row.pool is not None and row.hold_until is None
                row = dataclasses.replace(row, pool=None)  # an old row: no pool either
            rows.append(row)
        old = decide(engine, req, who, _id_at(now - 7200, 99), now - 7200)[1]  # its hold passed long ago
        await asyncio.gather(*(log.record_decision(r) for r in [old, *rows]))
        for r in rows[3:7]:  # four outcomes came back
            await log.record_feedback((r.decision_id, "a", now - 5, 100.0, None, 5, 0, None, 40.0, None, None, None))
        await log.close()
        return rows

    rows = asyncio.run(write())
    pool = {r.decision_id: pool_key(r.model, r.offering_id) for r in rows}
    events = list(decision_events(db, since=now - 3 * 3600))
    assert sum(isinstance(e, Reserved) for e in events) == 11 and sum(isinstance(e, Released) for e in events) == 4
    first = events[0]
    assert isinstance(first, Reserved) and first.reservation_id == _id_at(now - 7200, 99) and first.slots == 1
    expected_s = decide(engine, req, who, "x", now)[1].expected_latency_ms / 1000.0
    assert first.until == pytest.approx(now - 7200 + hold_for(expected_s), abs=5)
    assert {e.reservation_id: e.pool for e in events if isinstance(e, Reserved)} == {
        **pool, first.reservation_id: first.pool}
    assert [e.until for e in events if isinstance(e, Reserved) and e.reservation_id == rows[0].decision_id] == [now + 600]
    # only rows from `since` on are read (found by the decision id's time prefix)
    assert len(list(decision_events(db, since=now - 60))) == 10 + 4
    state = EmbeddedState()
    out = state.core.rebuild(events, now_wall=now)
    # held: rows 0-2 (long holds, no feedback); rows 7-9 derived holds of ~1-2 s passed by `now`: expired
    assert out == {"reserved": 11, "released": 4, "held": 3, "expired": 4}
    want: dict[str, int] = {}
    for r in rows[:3]:
        want[pool[r.decision_id]] = want.get(pool[r.decision_id], 0) + 1
    assert asyncio.run(in_flight(state)) == want
    assert sum(asyncio.run(expired(state)).values()) == 4
    # replaying twice books nothing more; a decision's feedback after the restart releases it
    assert state.core.rebuild(events, now_wall=now)["held"] == 3
    assert state.core.settle(Settlement(rows[1].decision_id)).pool == pool[rows[1].decision_id]


def test_redis_unreachable_fails_closed_then_recovers_and_fail_open_answers_locally() -> None:
    server = RedisServer().start()
    try:
        async def main() -> None:
            shared = RedisState(server.url, prefix=next(_prefixes), timeout_s=0.3)
            assert await reserve(shared, [("p", 1)], "before", 60) == "p"
            failovers: list[str] = []
            open_ = FailOpenState(RedisState(server.url, prefix=next(_prefixes), timeout_s=0.3), retry_s=0.2,
                                  on_failover=failovers.append)
            server.stop()
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: reserve(shared, [("p", 1)], "r", 60), lambda: release(shared, "before"),
                lambda: in_flight(shared), lambda: observe(shared, "p", 1.0), lambda: stats(shared, "p"),
                lambda: shared.claim("k", 60), lambda: shared.complete("k", b"x", 60)]
            for call in calls:
                t0 = time.monotonic()
                with pytest.raises(StateUnavailable, match=r"shared state redis://127\.0\.0\.1:\d+/0"):
                    await call()
                assert time.monotonic() - t0 < 3.0  # refused fast, not hung
            assert not await shared.healthy()
            # fail open: the local view answers, once logged
            assert await reserve(open_, [("p", 1)], "o1", 60) == "p"
            assert await reserve(open_, [("p", 1)], "o2", 60) is None  # the local view's capacity
            assert len(failovers) == 1 and open_.describe()["answering_locally"]
            assert await release(open_, "o1") == "p"
            server.start()
            assert await shared.healthy()
            assert await in_flight(shared) == {}  # the server came back empty (no persistence)
            assert await reserve(shared, [("p", 1)], "after", 60) == "p"
            await asyncio.sleep(0.25)  # past retry_s: the shared backend again
            assert await reserve(open_, [("q", 1)], "o3", 60) == "q"
            assert not open_.describe()["answering_locally"] and await in_flight(open_) == {"q": 1}
            await shared.close()
            await open_.close()

        asyncio.run(main())
    finally:
        server.close()


def test_open_state_and_redacted_urls(redis_server: Any) -> None:
    assert isinstance(open_state(StateSettings()), EmbeddedState)
    shared = open_state(StateSettings(backend="redis", url=redis_server.url))
    assert isinstance(shared, RedisState)
    wrapped = open_state(StateSettings(backend="redis", url=redis_server.url, fail_open=True))
    assert isinstance(wrapped, FailOpenState)
    with pytest.raises(ValueError, match="state_url"):
        open_state(StateSettings(backend="redis"))
    assert redact("redis://user:s3cret@h:6380/2") == "redis://h:6380/2"
    assert "s3cret" not in str(RedisState("redis://:s3cret@127.0.0.1:1/0").describe())
    asyncio.run(shared.close())
    asyncio.run(wrapped.close())


def test_settings_name_the_field_and_the_router_reports_its_state(redis_server: Any, tmp_path: Path) -> None:
    import httpx

    from router.app.factory import create_app
    from tests.servers import ServerThread
    from xroute.errors import ConfigError

    with pytest.raises(ConfigError, match="field 'state_url': needed with state_backend: redis"):
        make_setup(tmp_path / "a", state_backend="redis")
    with pytest.raises(ConfigError, match=r"field 'state_url'.*redis://"):
        make_setup(tmp_path / "b", state_backend="redis", state_url="http://127.0.0.1:1")
    setup = make_setup(tmp_path / "c", state_backend="redis", state_url=redis_server.url, state_prefix="t-status")
    with ServerThread(create_app(setup.settings)) as url:
        st = httpx.get(f"{url}/v1/admin/status", headers=setup.auth("admin"), timeout=10).json()["state"]
    assert st["backend"] == "redis" and st["url"] == redis_server.url and st["prefix"] == "t-status:{router}:"


# ---------------------------------------------------------------------------------------- processes
CAPACITY = {"p1": 3, "p2": 2}


def _hammer(url: str, prefix: str, worker: int, seconds: float, out: Any) -> None:
    """One OS process: reserve on the ranked pools, hold a moment, release; records each admitted
    interval [after reserve returned, before release was sent] on the system-wide monotonic clock."""
    import random

    async def main() -> tuple[list[tuple[str, float, float]], int]:
        s = RedisState(url, prefix=prefix, timeout_s=5.0)
        rng = random.Random(worker)
        held: list[tuple[str, float, float]] = []
        refused = 0
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            i += 1
            rid = f"w{worker}-{i}"
            pool = await reserve(s, list(CAPACITY.items()), rid, 30)
            if pool is None:
                refused += 1
                await asyncio.sleep(rng.random() * 0.002)
                continue
            t0 = time.monotonic()
            await asyncio.sleep(rng.random() * 0.004)
            t1 = time.monotonic()
            assert await release(s, rid) == pool
            held.append((pool, t0, t1))
        await s.close()
        return held, refused

    out.put((worker, *asyncio.run(main())))


@pytest.mark.slow
def test_processes_hammering_one_redis_never_exceed_a_pools_capacity(redis_server: Any) -> None:
    prefix = next(_prefixes)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(redis_server.url, prefix, k, 3.0, q)) for k in range(6)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    intervals = [iv for _, held, _ in results for iv in held]
    refused = sum(r for _, _, r in results)
    assert len(intervals) > 300 and refused > 0, (len(intervals), refused)  # real contention
    for pool, capacity in CAPACITY.items():
        edges = sorted([(t0, 1) for p, t0, _ in intervals if p == pool] + [(t1, -1) for p, _, t1 in intervals
                                                                             if p == pool], key=lambda e: (e[0], e[1]))
        level = most = 0
        for _, step in edges:
            level += step
            most = max(most, level)
        assert most <= capacity, (pool, most, capacity)
        assert most == capacity  # the pool was filled, not merely never reached

    async def left() -> dict[str, int]:
        s = RedisState(redis_server.url, prefix=prefix)
        try:
            return await in_flight(s)
        finally:
            await s.close()

    assert asyncio.run(left()) == {}


def test_a_redis_that_lost_its_data_begins_a_new_epoch_and_each_log_is_restored_once(redis_server: Any) -> None:
    """The epoch is begun by the first reader and stays until the data goes; ``restore`` books the
    log's reservations whose hold has not passed, applies its releases, leaves a reservation already
    held alone, restores idempotency answers without overwriting a live one -- once per epoch and
    log; after a flush (what a restart without persistence leaves) a new epoch takes it again."""
    prefix = next(_prefixes)

    async def main() -> None:
        s = RedisState(redis_server.url, prefix=prefix)
        raw = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            first = await s.epoch()
            assert await s.epoch() == first and abs(first.started - time.time()) < 5
            assert await reserve(s, [("p", 5)], "live", 60) == "p"  # made in this epoch: the log has it too
            now = time.time()
            events = [Reserved("d1", "p", now + 30), Reserved("d2", "p", now + 30), Reserved("old", "p", now - 1),
                      Reserved("live", "p", now + 30), Released("d2"), Reserved("d3", "q", now + 30, slots=2)]
            answers = [("k1", b"first answer", now + 60), ("gone", b"x", now - 1), ("k2", b"from the log", now + 60)]
            await s.complete("k2", b"live answer", 60)
            got = await s.restore(first, "log-a", events, answers, now)
            assert got == {"reserved": 3, "released": 1, "idempotency_keys": 1}
            assert await in_flight(s) == {"p": 2, "q": 2}  # live + d1, d3's two slots; old and d2 not
            assert (await s.claim("k1", 60)).answer == b"first answer"
            assert (await s.claim("k2", 60)).answer == b"live answer"
            assert (await s.claim("gone", 60)).status == "new"
            assert await s.restore(first, "log-a", events, answers, now) is None  # once per epoch and log
            assert await s.restore(first, "log-b", [Reserved("b1", "p", now + 30)], [], now) == {
                "reserved": 1, "released": 0, "idempotency_keys": 0}
            # the release of a restored reservation is the live one's
            assert await release(s, "d1") == "p" and await in_flight(s) == {"p": 2, "q": 2}
            await raw.delete(*[k async for k in raw.scan_iter(match=f"{prefix}:*")])  # the data is gone
            second = await s.epoch()
            assert second != first and second.started >= first.started
            assert await s.restore(second, "log-a", events, answers, now) == {  # "live" is the log's too now
                "reserved": 4, "released": 1, "idempotency_keys": 2}
            assert await in_flight(s) == {"p": 2, "q": 2}
        finally:
            await raw.aclose()
            await s.close()

    asyncio.run(main())


def test_a_key_the_state_lacks_is_not_claimed_until_every_log_is_back(redis_server: Any) -> None:
    """The idempotency guard across a loss (issue 21, finding 1): a key the state lacks is not
    claimed -- ``StateRestoring``, the API's 503 -- while this router has not restored into the
    current epoch (or there is none), in the epoch's first ``restore_window_s``, and while another
    router's announced restore has not ended (or lapsed); a key the state holds is answered as ever;
    a key being decided when the loss is noticed comes back pending."""
    prefix = next(_prefixes)

    async def main() -> None:
        a = RedisState(redis_server.url, prefix=prefix, restore_window_s=0.4)
        b = RedisState(redis_server.url, prefix=prefix, restore_window_s=0.4, restore_lapse_s=1.5)
        raw = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            with pytest.raises(StateRestoring):  # no epoch at all: nobody has restored anything
                await a.claim("k", 60)
            epoch = await a.epoch()
            await a.end_restore(epoch, "log-a", True)
            with pytest.raises(StateRestoring):  # the window: others may not have noticed yet
                await a.claim("k", 60)
            with pytest.raises(StateRestoring):  # b has not restored into this epoch
                await b.claim("k", 60)
            await asyncio.sleep(0.45)
            await b.begin_restore(epoch, "log-b")  # b reads its log...
            with pytest.raises(StateRestoring):
                await a.claim("k", 60)
            await b.end_restore(epoch, "log-b", True)  # ... and is done
            assert await a.claim("k", 60) == Claim("new")
            assert await b.claim("k", 60) == Claim("pending")
            await a.complete("k", b"answer", 60)
            assert await b.claim("k", 60) == Claim("done", b"answer")
            assert await a.claim("in flight", 60) == Claim("new")  # being decided when the data goes
            await raw.delete(*[k async for k in raw.scan_iter(match=f"{prefix}:*")])
            with pytest.raises(StateRestoring):  # the epoch is gone: a has not restored into the next
                await a.claim("k", 60)
            second = await b.epoch()
            assert second != epoch
            await b.begin_restore(second, "log-b")  # and dies before it ends: its announcement lapses
            await a.begin_restore(second, "log-a")
            assert await a.restore(second, "log-a", [], [("k", b"answer", time.time() + 60)]) is not None
            await a.end_restore(second, "log-a", True)
            assert await a.claim("k", 60) == Claim("done", b"answer")  # restored keys are answered at once
            await asyncio.sleep(0.45)
            with pytest.raises(StateRestoring):  # b's announced restore holds the others back ...
                await a.claim("other", 60)
            assert await a.claim("in flight", 60) == Claim("pending")  # (put back pending by a's restore)
            await asyncio.sleep(1.1)
            assert await a.claim("other", 60) == Claim("new")  # ... until it lapses
            unguarded = RedisState(redis_server.url, prefix=prefix)  # a process that restores nothing
            await raw.delete(*[k async for k in raw.scan_iter(match=f"{prefix}:*")])
            assert await unguarded.claim("k", 60) == Claim("new")
            await unguarded.close()
        finally:
            await raw.aclose()
            await a.close()
            await b.close()

    asyncio.run(main())


def test_a_state_in_this_process_has_no_epoch() -> None:
    async def main() -> None:
        assert await EmbeddedState().epoch() is None

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- the protocol
async def _commands(raw: Any, marker: Any, call: Callable[[], Awaitable[Any]]) -> tuple[Any, list[str]]:
    """What ``call`` answered, and the commands the server received from clients while it ran
    (``MONITOR``: those a script runs are marked ``lua`` and not counted; ``marker``, another
    client, says where the call ended)."""
    async with raw.monitor() as m:
        got = await call()
        await marker.echo("end of call")
        seen = []
        while True:
            c = await asyncio.wait_for(m.next_command(), 5)
            if "end of call" in c["command"]:
                return got, seen
            if c["client_type"] != "lua":
                seen.append(c["command"].split()[0].upper())


def test_admit_and_settle_on_redis_are_one_round_trip_whatever_the_options() -> None:
    """``admit`` -- ranked pools, a quota charge, a prefix record with a session, in every
    combination, admitted or refused -- and ``settle`` -- release, outcome, quota, cached tokens --
    each reach a real redis-server as exactly one command: one ``EVALSHA`` (one script, one round
    trip; counted in the server's own ``INFO commandstats``, nothing else talking to it)."""
    server = RedisServer().start()
    try:
        async def main() -> None:
            s = RedisState(server.url, prefix="rt")
            raw = redis.asyncio.Redis.from_url(server.url)
            marker = redis.asyncio.Redis.from_url(server.url)
            quota = QuotaCharge([QuotaBucket("t:a", "tenant", "a", None, (-1.0, 10_000.0, 3.0, -1.0))], 100, 0.5)
            send = PrefixSend(np.array([11, 22, 33], dtype=np.int64), "a:s1", 600.0,
                              {"p": (64, 512.0, 0.0), "q": (64, 0.0, 0.0)})
            cands = [("p", 4), ("q", 1)]
            try:
                await marker.ping()  # (connected before counting)
                assert (await s.admit(Admission("warm", cands, 60, quota, send))).pool == "p"  # scripts loaded
                await s.settle(Settlement("warm", outcome=PoolOutcome("p", 1.0, 2.0), quota=QUOTA_UNDO,
                                          cached_tokens=1.0, retention_alpha=0.1))
                calls, answers = [], []
                for i, (q, p) in enumerate([(None, None), (quota, None), (None, send), (quota, send), (quota, send),
                                            (quota, send), (quota, send)]):
                    if i == 6:
                        await s.settle(Settlement("d0"))  # room again in p: the quota (3 a day) refuses
                    admission = Admission(f"d{i}", cands, 60, q, p, fair=("a", 3.5) if i % 2 else None)
                    got, seen = await _commands(raw, marker, lambda a=admission: s.admit(a))
                    calls.append(seen)
                    answers.append((got.pool, None if got.refused is None else got.refused.name))
                assert answers == [("p", None), ("p", None), ("p", None), ("p", None), ("q", None), (None, None),
                                   (None, "requests_per_day")], answers
                assert calls == [["EVALSHA"]] * 7, calls
                settled, seen = await _commands(raw, marker, lambda: s.settle(Settlement(
                    "d3", outcome=PoolOutcome("p", 100.0, 900.0), quota=QuotaSettle(80, 0.25), cached_tokens=256.0,
                    retention_alpha=0.5, fair=("a", -1.0))))
                assert seen == ["EVALSHA"] and settled.pool == "p" and settled.quota and settled.retention_pool == "p"
            finally:
                await raw.aclose()
                await marker.aclose()
                await s.close()

        asyncio.run(main())
    finally:
        server.close()


def _random_ops(seed: int, n: int) -> list[tuple[Any, ...]]:
    """A random sequence of every protocol operation (no waits: nothing expires)."""
    import random

    rng = random.Random(seed)
    pools = [f"m|o{k}" for k in range(4)]
    quota = TenantQuotas.model_validate({"max_concurrent": 5, "tokens_per_minute": 30_000, "requests_per_day": 30,
                                         "usd_per_day": 2.0, "models": {"x": {"max_concurrent": 2, "usd_per_day": 0.6}}})
    ops: list[tuple[Any, ...]] = []
    prompts: list[list[int]] = []
    for _ in range(n):
        r, rid = rng.random(), f"d{rng.randrange(40)}"
        if r < 0.4:
            cands = [(p, rng.randint(0, 8)) for p in rng.sample(pools, rng.randint(1, 3))]
            charge = QuotaCharge(buckets_for(quota, "a", rng.choice(["x", "y"])), rng.randint(100, 4000),
                                 round(rng.uniform(0, 0.3), 4)) if rng.random() < 0.6 else None
            send = None
            if rng.random() < 0.6:
                base = rng.choice(prompts) if prompts and rng.random() < 0.6 else []
                prompt = base[:rng.randint(0, len(base))] + [rng.randrange(-2**62, 2**62) for _ in range(rng.randint(1, 4))]
                prompts.append(prompt)
                send = PrefixSend(np.array(prompt, dtype=np.int64), rng.choice([None, f"a:s{rng.randrange(4)}"]), 600.0,
                                  {p: (rng.randint(3, 30), float(rng.randint(0, 2048)), 0.0) for p, _ in cands})
            ops.append(("admit", Admission(rid, cands, 600.0, charge, send, slots=rng.choice([1, 1, 2]))))
        elif r < 0.65:
            outcome = PoolOutcome(rng.choice(pools), rng.choice([None, rng.uniform(10, 900)]),
                                  rng.choice([None, rng.uniform(100, 9000)]), rng.random() < 0.2) \
                if rng.random() < 0.6 else None
            q = rng.choice([None, QUOTA_UNDO, QuotaSettle(rng.choice([None, rng.randint(0, 5000)]),
                                                          rng.choice([None, round(rng.uniform(0, 0.4), 4)]))])
            ops.append(("settle", Settlement(rid, rng.random() < 0.8, outcome, q,
                                             rng.choice([None, float(rng.randint(0, 2048))]), 0.3)))
        elif r < 0.75:
            prompt = rng.choice(prompts) if prompts else [1]
            ops.append(("lookup", np.array(prompt[:rng.randint(1, len(prompt))], dtype=np.int64),
                        rng.choice([None, f"a:s{rng.randrange(4)}"])))
        elif r < 0.85:
            ops.append(("view", ["t:a", "m:a|x", "m:a|y"], rng.random() < 0.5))
        elif r < 0.95:
            ops.append((rng.choice(["claim", "complete", "abandon"]), f"a:route:k{rng.randrange(6)}"))
        else:
            ops.append(("put_session", f"a:s{rng.randrange(4)}", rng.choice(pools).encode()))
    return ops


async def _play(s: SharedState, ops: list[tuple[Any, ...]]) -> list[Any]:
    """What each operation answered, floats rounded (Redis keeps them as strings of 17 digits)."""
    def r9(x: Any) -> Any:
        return round(x, 9) if isinstance(x, float) else x

    out: list[Any] = []
    for op in ops:
        if op[0] == "admit":
            got = await s.admit(op[1])
            v = got.refused
            out.append((got.pool, None if v is None else (v.bucket, v.name, v.limit, r9(v.used), v.requested)))
        elif op[0] == "settle":
            out.append(await s.settle(op[1]))
        elif op[0] == "lookup":
            a = await s.lookup(op[1], op[2], 600.0)
            out.append((a.runs, {p: r9(x) for p, x in a.retention.items()}, a.session_pool))
        elif op[0] == "view":
            v = await s.view(op[1], op[2])
            out.append((v.in_flight, v.expired, {p: r9(x) for p, x in v.durations.items()},
                        {k: (u.concurrent, u.tokens_window, u.requests_day, r9(u.usd_day)) for k, u in v.quotas.items()}))
        elif op[0] == "claim":
            out.append(await s.claim(op[1], 600.0))
        elif op[0] == "complete":
            out.append(await s.complete(op[1], b"answer of " + op[1].encode(), 600.0))
        elif op[0] == "abandon":
            out.append(await s.abandon(op[1]))
        else:
            out.append(await s.put_session(op[1], op[2], 600.0))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_operation_answers_alike_on_both_backends(redis_server: Any, seed: int) -> None:
    """One random sequence of every protocol operation -- admissions with and without a quota
    charge and a prefix record (refused for room and for quotas), settlements of every part (and
    of ids never admitted), lookups, views with durations and quota usage, idempotency keys,
    session placements -- on the embedded state and on a real Redis: the same answer to each."""
    ops = _random_ops(seed, 400)

    async def both() -> tuple[list[Any], list[Any]]:
        red = RedisState(redis_server.url, prefix=next(_prefixes))
        try:
            return await _play(EmbeddedState(), ops), await _play(red, ops)
        finally:
            await red.close()

    a, b = asyncio.run(both())
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == y, (i, ops[i], x, y)
    admits = [x for op, x in zip(ops, a) if op[0] == "admit"]
    assert sum(p is not None for p, _ in admits) > 20 and sum(v is not None for _, v in admits) > 5  # both refusals
    assert sum(p is None and v is None for p, v in admits) > 5
    assert any(x[0] for op, x in zip(ops, a) if op[0] == "lookup")  # affinity matched


def test_a_cancelled_admission_takes_nothing_on_redis(redis_server: Any) -> None:
    """A request cancelled while its admission is on the wire: the pool and the quota the script
    took are given back when the answer arrives (the route's undo, in the next pipeline)."""
    async def main() -> None:
        s = RedisState(redis_server.url, prefix=next(_prefixes))
        b = [QuotaBucket("t:c", "tenant", "c", None, (5.0, -1.0, -1.0, -1.0))]
        try:
            task = asyncio.ensure_future(s.admit(Admission("gone", [("p", 3)], 60, QuotaCharge(b, 10, 0.1))))
            await asyncio.sleep(0)  # queued with the iteration's pipeline
            task.cancel()
            await asyncio.sleep(0.3)
            view = await s.view(["t:c"])
            assert view.in_flight == {} and view.quotas["t:c"].concurrent == 0 and view.quotas["t:c"].requests_day == 0
        finally:
            await s.close()

    asyncio.run(main())
