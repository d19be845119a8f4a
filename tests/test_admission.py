"""Admission that predicts, priority and fairness (issue 36; ``docs/router.md``, "Admission,
priority and fairness"): the fair queue against ``xroute.admission_rules.dispatch_order`` (a
property test), the fairness counters on both state backends, and -- over HTTP on real routers
(uvicorn on loopback; a real redis-server) with a one-slot pool, so overload is exact -- shedding
and queuing per band, dispatch as capacity frees, expiry, a client that goes away, a full queue,
two routers on one Redis applying one fairness, and the bad inputs."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.app.factory import create_app
from router.service.admission_queue import FairQueue
from router.service.ports import SharedState
from router.state.base import Admission, Settlement
from router.state.embedded import EmbeddedState
from router.state.redis import RedisState
from tests.servers import ServerThread
from tests.test_router_closed_loop import ONE_SLOT_SERVING
from tests.test_router_support import ROUTE, RouterSetup, make_setup
from xroute import admission_rules as rules
from xroute.errors import ConfigError

ONLY = {"constraints": {"allow": [{"offering_ids": ["aws:us-east-1:g5.xlarge:on_demand"]}]}}
#: a generous TTFT budget: a queued request waits for capacity, not for its budget
LONG = {**ROUTE, **ONLY, "ttft_ms": 20_000}
_prefixes = (f"adm{i}-{time.time_ns()}" for i in itertools.count())


# ---------------------------------------------------------------------------------------- the fair queue
class _W:
    def __init__(self, band: int, tenant: str, seq: int):
        self.band, self.tenant, self.seq = band, tenant, seq


_ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(0, 2), st.sampled_from("abcd")),
    st.tuples(st.just("pop"), st.integers(1, 500), st.just("")),
    st.tuples(st.just("drop"), st.integers(0, 50), st.just(""))), max_size=80)


@settings(max_examples=300, deadline=None)
@given(_ops, st.dictionaries(st.sampled_from("abcd"), st.floats(0, 1000, allow_nan=False)))
def test_the_fair_queue_dispatches_as_the_reference_order(ops: list[tuple[str, int, str]],
                                                          start: dict[str, float]) -> None:
    """Random arrivals, dispatches (each moving its tenant's counter by a service) and departures
    (expiry, a client gone): the queue's first is always ``dispatch_order``'s first over what waits,
    and ``push`` says when a tenant becomes backlogged."""
    q: FairQueue[_W] = FairQueue()
    waiting: list[_W] = []
    counters = dict(start)
    for seq, (op, x, tenant) in enumerate(ops):
        if op == "push":
            w = _W(x, tenant, seq)
            assert q.push(w) == (tenant not in {v.tenant for v in waiting})
            waiting.append(w)
        elif op == "drop" and waiting:
            w = waiting.pop(x % len(waiting))
            assert q.remove(w) and not q.remove(w)
        elif op == "pop":
            ref = rules.dispatch_order([(w.band, w.tenant, w.seq) for w in waiting], counters)
            got = q.first(counters)
            if not waiting:
                assert got is None
                continue
            assert got is waiting[ref[0]]
            assert q.remove(got)
            waiting.remove(got)
            counters[got.tenant] = counters.get(got.tenant, 0.0) + x
        assert len(q) == len(waiting)
        assert q.tenants() == sorted({w.tenant for w in waiting})
        assert q.per_band == [sum(w.band == b for w in waiting) for b in range(len(rules.BANDS))]
        for band in rules.BANDS:  # an arrival of this band would not overtake a request ahead of it
            assert rules.waits_ahead(band, q.per_band) == any(w.band <= rules.band_index(band) for w in waiting)


# ---------------------------------------------------------------------------------------- the counters
@pytest.fixture(params=["embedded", "redis"])
def make_state(request: pytest.FixtureRequest) -> Callable[[], SharedState]:
    if request.param == "embedded":
        return EmbeddedState
    url = request.getfixturevalue("redis_server").url
    prefix = next(_prefixes)
    return lambda: RedisState(url, prefix=prefix)


def test_fairness_counters_move_inside_admit_and_settle_alike_on_both_backends(
        make_state: Callable[[], SharedState]) -> None:
    """An admission's ``fair`` counts its service (nothing when no pool has room, nothing twice for
    a retry of a held id), a settlement's corrects it, and ``fairness`` lifts a just backlogged
    tenant to the lowest of the others -- the same numbers in process and on Redis."""
    async def main() -> None:
        s = make_state()
        try:
            svc = rules.service(400, 80, 2.0)
            assert (await s.admit(Admission("r1", [("p", 1)], 60, fair=("a", svc)))).pool == "p"
            assert (await s.admit(Admission("r1", [("p", 1)], 60, fair=("a", svc)))).pool == "p"  # a retry
            assert (await s.admit(Admission("r2", [("p", 1)], 60, fair=("a", svc)))).pool is None  # full
            assert await s.fairness(["a", "b"]) == {"a": pytest.approx(svc), "b": 0.0}
            await s.settle(Settlement("r1", fair=("a", rules.correction(80, 20, 2.0))))
            assert (await s.fairness(["a"]))["a"] == pytest.approx(rules.service(400, 20, 2.0))
            assert (await s.admit(Admission("r3", [("p", 1)], 60, fair=("b", 10.0)))).pool == "p"
            # c becomes backlogged beside a and b: lifted to the lowest of theirs (b's 10), a untouched
            got = await s.fairness(["a", "b", "c"], ["c"])
            assert got == {"a": pytest.approx(rules.service(400, 20, 2.0)), "b": 10.0, "c": 10.0}
            assert (await s.fairness(["c"], ["c"]))["c"] == 10.0  # alone: nothing to lift to
        finally:
            await s.close()

    asyncio.run(main())


def test_a_tenant_backlogged_while_the_counters_cannot_be_read_is_still_lifted(redis_server: Any) -> None:
    """A fairness read that fails (the shared state away: a real client on a closed port) keeps the
    just-backlogged tenants' lifts for the next read, and meanwhile counts them at the lowest of the
    others, never 0 -- dropped, a newly backlogged tenant would jump ahead of every tenant that had
    waited, and its shared counter would never be lifted."""
    from router.service.admission_queue import AdmissionQueue

    async def main() -> None:
        up = RedisState(redis_server.url, prefix=next(_prefixes))
        down = RedisState("redis://127.0.0.1:9", prefix="down")  # (the discard port: nothing listens)
        try:
            assert (await up.admit(Admission("r1", [("p", 1)], 60, fair=("a", 50.0)))).pool == "p"

            class Once:  # the shared state, away for one read
                failed = False

                async def fairness(self, tenants: Any, lift: Any = ()) -> dict[str, float]:
                    if not self.failed:
                        self.failed = True
                        return await down.fairness(tenants, lift)  # type: ignore[no-any-return]
                    return await up.fairness(tenants, lift)  # type: ignore[no-any-return]

            q = AdmissionQueue(Once(), 8, 0.05, None)
            q._counters = {"a": 50.0}  # the last read: a backlogged, 50 served
            for i, t in enumerate(["a", "b"]):
                if q.fq.push(_W(1, t, i)) and t == "b":  # b becomes backlogged (wait() lifts it)
                    q._lift.add(t)
            assert (await q._counters_now()) == {"a": 50.0, "b": 50.0}  # the read failed: lifted here
            assert await up.fairness(["b"]) == {"b": 0.0}  # not yet in the shared state
            assert (await q._counters_now()) == {"a": 50.0, "b": 50.0}  # the next read lifts it there
            assert await up.fairness(["b"]) == {"b": 50.0}
        finally:
            await up.close()
            await down.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- over HTTP
def _setup(tmp: Path, admission: dict[str, Any] | None = None, queue_timeout_s: float = 0.001,
           **kw: Any) -> RouterSetup:
    # slots free only when a test reports its decision's outcome: no hold expires within a test, however
    # slow the machine (a busy one made a hold run out and a second slot free under the two routers' test)
    kw.setdefault("state_hold_floor_s", 3600.0)
    setup = make_setup(tmp, replay_speed=1e-6, admission={"enabled": True, "recheck_s": 0.05, **(admission or {})},
                       env={"serving_config": str(tmp / "serving.yaml"), "queue_timeout_s": queue_timeout_s}, **kw)
    (tmp / "serving.yaml").write_text(ONE_SLOT_SERVING)  # (make_setup wrote the default one)
    return setup


def _route(url: str, setup: RouterSetup, who: str = "a", timeout: float = 30.0, **body: Any) -> httpx.Response:
    _ADMIN[url] = setup.auth("admin")
    return httpx.post(f"{url}/v1/route", json={**LONG, **body}, headers=setup.auth(who), timeout=timeout)


def _done(url: str, setup: RouterSetup, answer: httpx.Response, who: str = "a", output_tokens: int = 80) -> None:
    fb = {"decision_id": answer.json()["decision_id"], "latency_ms": 900.0, "ttft_ms": 200.0,
          "output_tokens": output_tokens}
    got = httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth(who), timeout=10)
    assert got.status_code == 201, (got.text, answer.text)


#: each router's admin headers (``/metrics`` is an admin's), by URL
_ADMIN: dict[str, dict[str, str]] = {}


def _metric(url: str, name: str, **labels: str) -> float:
    got = httpx.get(f"{url}/metrics", headers=_ADMIN[url], timeout=10)
    assert got.status_code == 200, got.text
    text = got.text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return 0.0


def _waiting(url: str, n: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while _metric(url, "xroute_router_admission_queue_length") != n:
        assert time.monotonic() < deadline, f"never {n} waiting"
        time.sleep(0.02)


def _fill(url: str, setup: RouterSetup, who: str = "b") -> list[httpx.Response]:
    """Route ``who``'s sheddable requests until the one-slot pool refuses one (429 slo_unattainable at once)."""
    placed = []
    while True:
        r = _route(url, setup, who=who, priority="sheddable")
        if r.status_code != 200:
            assert r.status_code == 429 and r.json()["error"] == "slo_unattainable", r.text
            assert r.json()["priority"] == "sheddable" and int(r.headers["retry-after"]) >= 1
            assert "best_predicted_ttft_ms" in r.json()
            return placed
        placed.append(r)
        assert len(placed) < 10


def test_overload_sheds_sheddable_queues_the_others_and_dispatches_highest_band_first(tmp_path: Path) -> None:
    """The pool full: a sheddable request is refused at once; standard then critical requests wait
    (no answer yet) and, as feedback frees the slot one request at a time, the critical one is
    placed first, then the standard one; the queue's length and waits are in /metrics."""
    setup = _setup(tmp_path)
    with ServerThread(create_app(setup.settings)) as url, ThreadPoolExecutor(4) as pool:
        placed = _fill(url, setup)
        assert placed
        t0 = time.monotonic()
        standard: Future[httpx.Response] = pool.submit(_route, url, setup, "a")
        _waiting(url, 1)
        critical: Future[httpx.Response] = pool.submit(_route, url, setup, "a", priority="critical")
        _waiting(url, 2)
        time.sleep(0.2)  # several re-checks: nothing frees, nothing is placed
        assert not standard.done() and not critical.done()
        _done(url, setup, placed[0], who="b")
        first = critical.result(10)
        assert first.status_code == 200, first.text
        _waiting(url, 1)
        assert not standard.done()
        for r in placed[1:]:
            _done(url, setup, r, who="b")
        _done(url, setup, first)
        second = standard.result(10)
        assert second.status_code == 200 and time.monotonic() - t0 < 10
        _waiting(url, 0)
        assert _metric(url, "xroute_router_admission_total", band="sheddable", outcome="shed") == 1
        assert _metric(url, "xroute_router_admission_total", band="critical", outcome="dispatched") == 1
        assert _metric(url, "xroute_router_admission_wait_seconds_count", outcome="dispatched") == 2


def test_a_queued_request_leaves_when_its_budget_runs_out_or_its_client_goes(tmp_path: Path) -> None:
    """A standard request with a 600 ms TTFT budget waits that long, then gets 429
    slo_unattainable; one whose client gives up leaves the queue (counted as left) and the next
    capacity goes to nobody it abandoned."""
    setup = _setup(tmp_path)
    with ServerThread(create_app(setup.settings)) as url:
        placed = _fill(url, setup)
        t0 = time.monotonic()
        r = _route(url, setup, ttft_ms=600)
        waited = time.monotonic() - t0
        assert r.status_code == 429 and r.json()["error"] == "slo_unattainable" and r.json()["priority"] == "standard"
        assert 0.5 <= waited < 5, waited
        assert _metric(url, "xroute_router_admission_total", band="standard", outcome="expired") == 1
        with pytest.raises(httpx.ReadTimeout):
            _route(url, setup, timeout=0.5)  # the client goes away while it waits
        deadline = time.monotonic() + 5
        while _metric(url, "xroute_router_admission_total", band="standard", outcome="left") != 1:
            assert time.monotonic() < deadline, "the abandoned request never left the queue"
            time.sleep(0.05)
        _waiting(url, 0)
        for p in placed:
            _done(url, setup, p, who="b")
        assert _route(url, setup).status_code == 200  # the capacity is there, not taken by the abandoned one


def test_a_full_queue_refuses_naming_its_limit(tmp_path: Path) -> None:
    setup = _setup(tmp_path, {"queue_limit": 1})
    with ServerThread(create_app(setup.settings)) as url, ThreadPoolExecutor(2) as pool:
        _fill(url, setup)
        waiting = pool.submit(_route, url, setup, "a", ttft_ms=1500)
        _waiting(url, 1)
        full = _route(url, setup)
        assert full.status_code == 429 and full.json()["error"] == "admission_queue_full"
        assert full.json()["queue_limit"] == 1 and "queue_limit" in full.json()["message"]
        assert waiting.result(10).status_code == 429  # (its budget ran out)


def test_two_routers_on_one_redis_apply_one_fairness(tmp_path: Path, redis_server: Any) -> None:
    """Router 1 serves tenant a (its counter grows in the shared state); router 2 has never served
    a. On router 2, b then a wait for the full pool: when router 1's feedback frees the slot, router
    2 places b first -- it reads a's counter from the shared state (counted apart, a would go
    first: equal counters, and a before b by name)."""
    shared = {"state_backend": "redis", "state_url": redis_server.url, "state_prefix": next(_prefixes)}
    s1, s2 = _setup(tmp_path / "r1", **shared), _setup(tmp_path / "r2", **shared)
    with ServerThread(create_app(s1.settings)) as url1, ServerThread(create_app(s2.settings)) as url2, \
            ThreadPoolExecutor(2) as pool:
        placed = _fill(url1, s1, "a")
        b = pool.submit(_route, url2, s2, "b")
        _waiting(url2, 1)
        a = pool.submit(_route, url2, s2, "a")
        _waiting(url2, 2)
        _done(url1, s1, placed[0])  # one slot frees (router 1's decision): router 2's next re-check sees it
        first = b.result(30)  # (a liveness wait on a loaded machine: what is checked is the order)
        assert first.status_code == 200, first.text
        _waiting(url2, 1)
        assert not a.done()
        for p in placed[1:]:
            _done(url1, s1, p)
        _done(url2, s2, first, who="b")
        assert a.result(30).status_code == 200


def test_capacity_another_router_frees_is_tried_once_the_shared_view_shows_it(tmp_path: Path,
                                                                              redis_server: Any) -> None:
    """A request waiting on router 2 for the slot router 1 holds is placed once router 2's shared view
    (read every ``state_view_refresh_s``, 0.05 s) shows the slot free -- not at router 2's next
    re-check (``admission.recheck_s`` 5 s here: the re-check alone placed it ~5 s after it queued)."""
    shared = {"state_backend": "redis", "state_url": redis_server.url, "state_prefix": next(_prefixes)}
    s1, s2 = _setup(tmp_path / "r1", **shared), _setup(tmp_path / "r2", {"recheck_s": 5.0}, **shared)
    with ServerThread(create_app(s1.settings)) as url1, ServerThread(create_app(s2.settings)) as url2, \
            ThreadPoolExecutor(1) as pool:
        placed = _fill(url1, s1, "a")
        b = pool.submit(_route, url2, s2, "b")
        _waiting(url2, 1)
        t0 = time.monotonic()
        _done(url1, s1, placed[0])  # one slot frees in the shared state (router 1's decision)
        got = b.result(30)
        took = time.monotonic() - t0
        assert got.status_code == 200, got.text
        assert took < 3.0, f"placed {took:.2f} s after the slot freed: at the re-check, not when the view showed it"
        _done(url2, s2, got, who="b")
        for p in placed[1:]:
            _done(url1, s1, p)


# ---------------------------------------------------------------------------------------- bad input
def test_bad_priority_weight_and_queue_limit_are_refused_naming_the_field(tmp_path: Path) -> None:
    for tenants, field in [({"a": {"priority": "urgent"}}, "tenants.a.priority"),
                           ({"a": {"weight": -1}}, "tenants.a.weight"), ({"a": {"weight": 0}}, "tenants.a.weight")]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            make_setup(tmp_path / "bad", tenants=tenants)
    with pytest.raises(ConfigError, match=r"admission.*queue_limit"):
        make_setup(tmp_path / "bad", admission={"enabled": True, "queue_limit": 0})
    make_setup(tmp_path / "ok", admission={"enabled": False, "queue_limit": 0})  # (no queue: no limit needed)
    setup = _setup(tmp_path / "serve")
    with ServerThread(create_app(setup.settings)) as url:
        r = _route(url, setup, priority="urgent")
        assert r.status_code == 422
        assert [f["field"] for f in r.json()["fields"]] == ["body.priority"]
        assert _route(url, setup).status_code == 200  # nothing was taken by the refused one


#: a second offering the one-slot pool's requests may be allowed (another region: slower, but free)
FAR = "gcp:europe-west4:g2-standard-4:on_demand"


def test_an_arrival_does_not_overtake_a_request_of_its_band_waiting(tmp_path: Path) -> None:
    """The one-slot pool full: a standard request allowed only that pool waits; a standard request
    arriving meanwhile that a free pool (``FAR``) would serve in time is not placed before it -- it
    waits behind it, and both are placed once the slot frees, the first one first; a sheddable one
    arriving meanwhile is shed at once (``admission_rules.waits_ahead``). Without the rule the
    arrival would take the free pool at once."""
    setup = _setup(tmp_path)
    with ServerThread(create_app(setup.settings)) as url, ThreadPoolExecutor(2) as pool:
        placed = _fill(url, setup)
        first: Future[httpx.Response] = pool.submit(_route, url, setup, "a")
        _waiting(url, 1)
        either = {"constraints": {"allow": [{"offering_ids": [ONLY["constraints"]["allow"][0]["offering_ids"][0], FAR]}]}}
        second: Future[httpx.Response] = pool.submit(_route, url, setup, "a", **either)
        _waiting(url, 2)
        shed = _route(url, setup, who="b", priority="sheddable", **either)
        assert shed.status_code == 429 and shed.json()["error"] == "slo_unattainable", shed.text
        time.sleep(0.2)  # several re-checks: the first still cannot be placed, and the second stays behind it
        assert not first.done() and not second.done()
        _done(url, setup, placed[0], who="b")
        r1 = first.result(10)
        assert r1.status_code == 200, r1.text
        r2 = second.result(10)
        assert r2.status_code == 200, r2.text
        assert _metric(url, "xroute_router_admission_total", band="standard", outcome="dispatched") == 2


def test_a_request_even_a_free_slot_cannot_serve_in_time_is_refused_at_once(tmp_path: Path) -> None:
    """The one-slot pool free: a standard request whose TTFT SLO even that free slot misses (a long
    prefill) cannot be helped by waiting (``admission_rules.soonest_ttft``): 429 slo_unattainable at
    once, counted as shed, nothing taken. Before, it waited its whole budget (1.5 s) at the head of
    the queue, holding back every request behind it."""
    setup = _setup(tmp_path)
    with ServerThread(create_app(setup.settings)) as url:
        big = {"input_tokens": 60_000}  # a long prefill: the free pool's predicted TTFT is seconds
        probe = _route(url, setup, who="b", priority="sheddable", ttft_ms=1, **big)  # nothing is under 1 ms
        assert probe.status_code == 429, probe.text
        free = float(probe.json()["best_predicted_ttft_ms"])  # the free pool's predicted TTFT for it
        budget_s = 1.5
        assert free > 1000.0 * budget_s, free
        t0 = time.monotonic()
        r = _route(url, setup, "a", **big, ttft_ms=1000.0 * budget_s)
        took = time.monotonic() - t0
        assert r.status_code == 429 and r.json()["error"] == "slo_unattainable", r.text
        assert r.json()["priority"] == "standard" and took < 0.5 * budget_s, took
        assert _metric(url, "xroute_router_admission_total", band="standard", outcome="shed") == 1
        assert _metric(url, "xroute_router_admission_total", band="standard", outcome="queued") == 0
        assert _route(url, setup).status_code == 200  # nothing was taken by the refused one


def test_a_full_pool_gets_no_queue_the_request_waits_in_the_routers(tmp_path: Path) -> None:
    """Pools allowed a queue (``queue_timeout_s`` 600: a full pool still counts, with a predicted wait):
    once the pool's slots are taken, a sheddable request is shed rather than queued at the pool, and a
    standard one with a budget the pool's queue would meet (120 s) waits in the router's queue --
    where the dispatch order, not the pool's first come first served, decides -- and is placed when
    the slot frees (``admission_rules``, "Where the waiting happens"). Before, both were placed in
    the pool's queue at once."""
    setup = _setup(tmp_path, queue_timeout_s=600.0)
    with ServerThread(create_app(setup.settings)) as url, ThreadPoolExecutor(1) as pool:
        placed = _fill(url, setup)
        refused = _route(url, setup, who="b", priority="sheddable")  # its slots taken, the pool takes no more:
        assert refused.status_code == 429 and refused.json()["best_predicted_ttft_ms"] is None  # every pool full
        waiting: Future[httpx.Response] = pool.submit(_route, url, setup, "a", ttft_ms=120_000)
        _waiting(url, 1)
        time.sleep(0.2)  # several re-checks: the pool is still full
        assert not waiting.done()
        _done(url, setup, placed[0], who="b")
        r = waiting.result(10)
        assert r.status_code == 200, r.text
        assert _metric(url, "xroute_router_admission_total", band="standard", outcome="dispatched") == 1
