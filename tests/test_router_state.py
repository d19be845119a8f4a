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

import pytest
import redis.asyncio

from router.decision.engine import RoutingEngine
from router.state.base import (
    Claim,
    Released,
    Reserved,
    RouterState,
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
from tests.test_router_support import ROUTE, make_setup
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest

_prefixes = (f"t{i}-{time.time_ns()}" for i in itertools.count())
Make = Callable[[], RouterState]


@pytest.fixture(params=["embedded", "redis"])
def make_state(request: pytest.FixtureRequest) -> Make:
    """A factory (called inside the test's event loop) of a fresh, empty state of each backend."""
    if request.param == "embedded":
        return EmbeddedState
    url = request.getfixturevalue("redis_server").url
    prefix = next(_prefixes)  # every test its own keys on the shared server
    return lambda: RedisState(url, prefix=prefix)


def _run(make: Make, body: Callable[[RouterState], Awaitable[None]]) -> None:
    async def main() -> None:
        state = make()
        try:
            await body(state)
        finally:
            await state.close()

    asyncio.run(main())


def test_check_and_reserve_release_and_retries(make_state: Make) -> None:
    async def body(s: RouterState) -> None:
        cands = [("pool a", 2), ("pool:b", 1)]  # opaque keys: spaces and colons are fine
        got = [await s.reserve(cands, f"r{i}", 60) for i in range(4)]
        assert got == ["pool a", "pool a", "pool:b", None]
        assert await s.in_flight() == {"pool a": 2, "pool:b": 1}
        assert await s.reserve(cands, "r0", 60) == "pool a"  # a retry: its pool, nothing booked
        assert await s.in_flight() == {"pool a": 2, "pool:b": 1}
        assert await s.release("r1") == "pool a"
        assert await s.release("r1") is None and await s.release("never") is None
        assert await s.reserve(cands, "r3", 60) == "pool a"
        # several slots at once, within capacity only
        assert await s.reserve([("big", 3)], "w1", 60, slots=2) == "big"
        assert await s.reserve([("big", 3)], "w2", 60, slots=2) is None
        assert await s.reserve([("big", 3)], "w3", 60, slots=1) == "big"
        assert (await s.in_flight())["big"] == 3
        assert await s.reserve([("zero", 0)], "z", 60) is None
        assert await s.expired() == {} or set((await s.expired()).values()) == {0}
        for bad in (dict(slots=0), dict(hold_s=0.0), dict(hold_s=math.inf)):
            with pytest.raises(ValueError):
                await s.reserve([("p", 1)], "bad", **{"hold_s": 1.0, **bad})  # type: ignore[arg-type]

    _run(make_state, body)


def test_concurrent_calls_of_one_iteration_each_get_their_own_answer(make_state: Make) -> None:
    """Calls made together (the Redis backend sends one event-loop iteration's calls as one
    pipeline) are each checked against what the ones before them reserved; a reservation whose
    caller is cancelled before the answer comes is not left held."""

    async def body(s: RouterState) -> None:
        got = await asyncio.gather(*(s.reserve([("p", 20), ("q", 5)], f"c{i}", 60) for i in range(30)))
        assert got.count("p") == 20 and got.count("q") == 5 and got.count(None) == 5
        assert got[:20] == ["p"] * 20  # in the order they were made
        released = await asyncio.gather(*(s.release(f"c{i}") for i in range(30)))
        assert released == got and await s.in_flight() == {}
        task = asyncio.ensure_future(s.reserve([("p", 20)], "gone", 60))
        await asyncio.sleep(0)  # queued (or, embedded, already done)
        task.cancel()
        await asyncio.sleep(0.2)
        # (in process the reservation was made before the cancel could come: the caller's to release)
        assert await s.in_flight() == ({"p": 1} if s.sync else {})

    _run(make_state, body)


def test_reservations_whose_release_never_comes_expire_and_are_counted(make_state: Make) -> None:
    async def body(s: RouterState) -> None:
        assert await s.reserve([("p", 1)], "lost", 0.2) == "p"
        assert await s.reserve([("p", 2)], "kept", 60) == "p"
        assert await s.reserve([("p", 2)], "released", 0.2) is None  # full: 2 slots held
        assert await s.release("kept") == "p"
        assert await s.reserve([("p", 2)], "released", 0.2) == "p"
        assert await s.release("released") == "p"  # released in time: not counted as expired
        await asyncio.sleep(0.35)
        assert await s.in_flight() == {}
        assert await s.expired() == {"p": 1}
        assert await s.release("lost") is None  # too late: already expired
        assert await s.reserve([("p", 1)], "next", 60) == "p"  # the slot is free again
        st = await s.stats("p")
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

    async def body(s: RouterState) -> None:
        empty = await s.stats("gpu")
        assert (empty.outcomes, empty.ttft_ms_mean, empty.failure_rate) == (0, None, None)
        for i, (t, f) in enumerate(zip(ttft, fails)):
            await s.observe("gpu", ttft_ms=t, duration_ms=dur[i] if i < len(dur) else None, failed=f)
        st = await s.stats("gpu")
        assert (st.pool, st.outcomes, st.failures) == ("gpu", 6, 2)
        m, sd = _reference(0.05, ttft)
        assert st.ttft_ms_mean == pytest.approx(m, rel=1e-12) and st.ttft_ms_std == pytest.approx(sd, rel=1e-9)
        m, sd = _reference(0.05, dur)
        assert st.duration_ms_mean == pytest.approx(m, rel=1e-12) and st.duration_ms_std == pytest.approx(sd, rel=1e-9)
        assert st.failure_rate == pytest.approx(_reference(0.05, [float(f) for f in fails])[0], rel=1e-12)
        assert (await s.stats("other")).outcomes == 0  # per pool
        with pytest.raises(ValueError):
            await s.observe("gpu", ttft_ms=math.nan)

    _run(make_state, body)


def test_idempotency_keys_first_answer_wins(make_state: Make) -> None:
    async def body(s: RouterState) -> None:
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
    async def body(s: RouterState) -> None:
        assert await s.get_session("a:s") is None
        await s.put_session("a:s", b"m|pool", 0.3)
        assert await s.get_session("a:s") == b"m|pool" and await s.get_session("b:s") is None
        await asyncio.sleep(0.4)
        assert await s.get_session("a:s") is None  # its TTL passed
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
            row = engine.decide(req, who, _id_at(t, i), t, state=book if i < 5 else None)[1]
            if i < 5:
                assert row.pool == book._held[row.decision_id][0] and row.hold_until > t  # type: ignore[operator]
                row = dataclasses.replace(row, hold_until=now + 600)  # a long hold
            else:
                assert row.pool is not None and row.hold_until is None
                row = dataclasses.replace(row, pool=None)  # an old row: no pool either
            rows.append(row)
        old = engine.decide(req, who, _id_at(now - 7200, 99), now - 7200)[1]  # its hold passed long ago
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
    expected_s = engine.decide(req, who, "x", now)[1].expected_latency_ms / 1000.0
    assert first.until == pytest.approx(now - 7200 + hold_for(expected_s), abs=5)
    assert {e.reservation_id: e.pool for e in events if isinstance(e, Reserved)} == {
        **pool, first.reservation_id: first.pool}
    assert [e.until for e in events if isinstance(e, Reserved) and e.reservation_id == rows[0].decision_id] == [now + 600]
    # only rows from `since` on are read (found by the decision id's time prefix)
    assert len(list(decision_events(db, since=now - 60))) == 10 + 4
    state = EmbeddedState()
    out = state.rebuild(events, now_wall=now)
    # held: rows 0-2 (long holds, no feedback); rows 7-9 derived holds of ~1-2 s passed by `now`: expired
    assert out == {"reserved": 11, "released": 4, "held": 3, "expired": 4}
    want: dict[str, int] = {}
    for r in rows[:3]:
        want[pool[r.decision_id]] = want.get(pool[r.decision_id], 0) + 1
    assert asyncio.run(state.in_flight()) == want
    assert sum(asyncio.run(state.expired()).values()) == 4
    # replaying twice books nothing more; a decision's feedback after the restart releases it
    assert state.rebuild(events, now_wall=now)["held"] == 3
    assert state.release_now(rows[1].decision_id) == pool[rows[1].decision_id]


def test_redis_unreachable_fails_closed_then_recovers_and_fail_open_answers_locally() -> None:
    server = RedisServer().start()
    try:
        async def main() -> None:
            shared = RedisState(server.url, prefix=next(_prefixes), timeout_s=0.3)
            assert await shared.reserve([("p", 1)], "before", 60) == "p"
            failovers: list[str] = []
            open_ = FailOpenState(RedisState(server.url, prefix=next(_prefixes), timeout_s=0.3), retry_s=0.2,
                                  on_failover=failovers.append)
            server.stop()
            calls: list[Callable[[], Awaitable[Any]]] = [
                lambda: shared.reserve([("p", 1)], "r", 60), lambda: shared.release("before"),
                lambda: shared.in_flight(), lambda: shared.observe("p", 1.0), lambda: shared.stats("p"),
                lambda: shared.claim("k", 60), lambda: shared.complete("k", b"x", 60)]
            for call in calls:
                t0 = time.monotonic()
                with pytest.raises(StateUnavailable, match=r"shared state redis://127\.0\.0\.1:\d+/0"):
                    await call()
                assert time.monotonic() - t0 < 3.0  # refused fast, not hung
            assert not await shared.healthy()
            # fail open: the local view answers, once logged
            assert await open_.reserve([("p", 1)], "o1", 60) == "p"
            assert await open_.reserve([("p", 1)], "o2", 60) is None  # the local view's capacity
            assert len(failovers) == 1 and open_.describe()["answering_locally"]
            assert await open_.release("o1") == "p"
            server.start()
            assert await shared.healthy()
            assert await shared.in_flight() == {}  # the server came back empty (no persistence)
            assert await shared.reserve([("p", 1)], "after", 60) == "p"
            await asyncio.sleep(0.25)  # past retry_s: the shared backend again
            assert await open_.reserve([("q", 1)], "o3", 60) == "q"
            assert not open_.describe()["answering_locally"] and await open_.in_flight() == {"q": 1}
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
            pool = await s.reserve(list(CAPACITY.items()), rid, 30)
            if pool is None:
                refused += 1
                await asyncio.sleep(rng.random() * 0.002)
                continue
            t0 = time.monotonic()
            await asyncio.sleep(rng.random() * 0.004)
            t1 = time.monotonic()
            assert await s.release(rid) == pool
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
            return await s.in_flight()
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
            assert await s.reserve([("p", 5)], "live", 60) == "p"  # made in this epoch: the log has it too
            now = time.time()
            events = [Reserved("d1", "p", now + 30), Reserved("d2", "p", now + 30), Reserved("old", "p", now - 1),
                      Reserved("live", "p", now + 30), Released("d2"), Reserved("d3", "q", now + 30, slots=2)]
            answers = [("k1", b"first answer", now + 60), ("gone", b"x", now - 1), ("k2", b"from the log", now + 60)]
            await s.complete("k2", b"live answer", 60)
            got = await s.restore(first, "log-a", events, answers, now)
            assert got == {"reserved": 3, "released": 1, "idempotency_keys": 1}
            assert await s.in_flight() == {"p": 2, "q": 2}  # live + d1, d3's two slots; old and d2 not
            assert (await s.claim("k1", 60)).answer == b"first answer"
            assert (await s.claim("k2", 60)).answer == b"live answer"
            assert (await s.claim("gone", 60)).status == "new"
            assert await s.restore(first, "log-a", events, answers, now) is None  # once per epoch and log
            assert await s.restore(first, "log-b", [Reserved("b1", "p", now + 30)], [], now) == {
                "reserved": 1, "released": 0, "idempotency_keys": 0}
            # the release of a restored reservation is the live one's
            assert await s.release("d1") == "p" and await s.in_flight() == {"p": 2, "q": 2}
            await raw.delete(*[k async for k in raw.scan_iter(match=f"{prefix}:*")])  # the data is gone
            second = await s.epoch()
            assert second != first and second.started >= first.started
            assert await s.restore(second, "log-a", events, answers, now) == {  # "live" is the log's too now
                "reserved": 4, "released": 1, "idempotency_keys": 2}
            assert await s.in_flight() == {"p": 2, "q": 2}
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
