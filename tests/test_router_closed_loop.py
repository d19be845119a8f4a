"""The closed loop over HTTP, against real servers on loopback: a decision reserves capacity in the
shared state, feedback releases it and teaches the pool's statistics, an ``Idempotency-Key``
retry gets the first answer's bytes and books nothing, a failure after the decision releases what
it reserved, a restart rebuilds the embedded state from the decision log, a Redis outage answers
503 naming the state (and recovers), a Redis that restarts empty is restored from every router's
log, and several router processes on one Redis never admit more
than a pool's capacity.

The in-process servers replay at 1e-6 telemetry seconds per second, so the pools' load comes from
the requests sent here only (nothing ends by itself while a test runs)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from router.app.factory import create_app
from router.state.base import pool_key
from router.state.embedded import EmbeddedState
from router.store.readers import iter_decisions
from tests.servers import REPO_ROOT, RedisServer, ServerThread, free_port, start_subprocess
from tests.state_support import core_stats
from tests.test_router_support import ROUTE, RouterSetup, make_setup, retry_restoring
from tests.tinybundle import SERVING_YAML


def _setup(tmp: Path, **kw: Any) -> RouterSetup:
    return make_setup(tmp, replay_speed=1e-6, env={"serving_config": str(tmp / "serving.yaml")}, **kw)


def _app(srv: ServerThread) -> Any:
    app = srv.config.loaded_app
    while not hasattr(app, "services"):
        app = app.app
    return app


def _in_flight(url: str, setup: RouterSetup) -> dict[str, int]:
    """The shared state's in-flight work per pool, as ``/v1/admin/status`` shows it."""
    got = httpx.get(f"{url}/v1/admin/status", headers=setup.auth("admin"), timeout=10).json()["state"]
    return got["in_flight"]  # type: ignore[no-any-return]


def _route(url: str, setup: RouterSetup, body: dict[str, Any] | None = None, key: str | None = None,
           who: str = "a") -> httpx.Response:
    headers = {**setup.auth(who), **({"Idempotency-Key": key} if key is not None else {})}
    return httpx.post(f"{url}/v1/route", json=body or ROUTE, headers=headers, timeout=10)


def _pool(answer: dict[str, Any], model: str) -> str:
    return pool_key(model, answer["offering"]["offering_id"])


def test_a_decision_reserves_and_feedback_releases_and_teaches_the_pool(tmp_path: Path) -> None:
    setup = _setup(tmp_path)
    with ServerThread(create_app(setup.settings)) as url:
        r = _route(url, setup)
        assert r.status_code == 200
        d = r.json()
        model = httpx.get(f"{url}/v1/offerings", headers=setup.auth("a")).json()["models"][0]
        pool = _pool(d, model)
        assert _in_flight(url, setup) == {pool: 1}
        offerings = httpx.get(f"{url}/v1/offerings", headers=setup.auth("a")).json()["offerings"]
        assert {o["offering"]["offering_id"]: o["reserved"] for o in offerings}[d["offering"]["offering_id"]] == 1
        fb = {"decision_id": d["decision_id"], "latency_ms": 900.0, "ttft_ms": 120.0, "output_tokens": 30}
        got = httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth("a"), timeout=10)
        assert got.status_code == 201 and got.json()["decision_id"] == d["decision_id"]
        assert _in_flight(url, setup) == {}
        # a second report of the same decision is stored, releases nothing more, is not counted twice
        again = httpx.post(f"{url}/v1/feedback", json={**fb, "latency_ms": 5000.0}, headers=setup.auth("a"))
        assert again.status_code == 201 and again.json()["feedback_id"] > got.json()["feedback_id"]
        rec = httpx.get(f"{url}/v1/decisions/{d['decision_id']}", headers=setup.auth("a")).json()
        assert [(f["latency_ms"], f["ttft_ms"]) for f in rec["feedback"]] == [(900.0, 120.0), (5000.0, 120.0)]


def test_feedback_updates_the_pools_statistics_once_and_frees_this_routers_view(tmp_path: Path) -> None:
    setup = _setup(tmp_path)
    srv = ServerThread(create_app(setup.settings))
    with srv as url:
        svc = _app(srv).services
        engine, state = svc.engine, svc.state
        assert isinstance(state, EmbeddedState)
        d = _route(url, setup).json()
        model = engine.models[0]
        pool = _pool(d, model)
        assert int(engine.env.inflight.sum()) == 1 and int(engine.own_held.sum()) == 1
        fb = {"decision_id": d["decision_id"], "latency_ms": 900.0, "ttft_ms": 120.0, "failed": False}
        assert httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
        assert httpx.post(f"{url}/v1/feedback", json={**fb, "latency_ms": 10.0},
                          headers=setup.auth("a")).status_code == 201
        st = core_stats(state, pool)
        assert (st.outcomes, st.ttft_ms_mean, st.duration_ms_mean, st.in_flight) == (1, 120.0, 900.0, 0)
        # this router's view learned the request ended: nothing of it left in flight or held as its own
        assert int(engine.env.inflight.sum()) == 0 and int(engine.own_held.sum()) == 0
        # another tenant's decision is a 404, and books nothing
        other = httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth("b"))
        assert other.status_code == 404 and other.json()["error"] == "not_found"


def test_an_idempotency_key_returns_the_first_answer_and_books_nothing(tmp_path: Path) -> None:
    setup = _setup(tmp_path)
    srv = ServerThread(create_app(setup.settings))
    with srv as url:
        first = _route(url, setup, key="order-17/a")
        assert first.status_code == 200
        again = _route(url, setup, key="order-17/a")
        assert again.status_code == 200 and again.content == first.content  # the same bytes
        assert sum(_in_flight(url, setup).values()) == 1
        # the same key with another body: refused, naming the header; another tenant's key is its own
        other = _route(url, setup, {**ROUTE, "input_tokens": 401}, key="order-17/a")
        assert other.status_code == 422 and other.json()["error"] == "idempotency_key_reused"
        assert other.json()["fields"][0]["field"] == "header.Idempotency-Key"
        b = _route(url, setup, key="order-17/a", who="b")
        assert b.status_code == 200 and b.json()["decision_id"] != first.json()["decision_id"]
        for bad in ("", "x" * 256, "two words"):
            r = _route(url, setup, key=bad)
            assert r.status_code == 422 and r.json()["fields"][0]["field"] == "header.Idempotency-Key", bad
        assert sum(_in_flight(url, setup).values()) == 2
        # feedback under a key: a retry gets the first answer, and one row is stored
        fb = {"decision_id": first.json()["decision_id"], "latency_ms": 700.0}
        f1 = httpx.post(f"{url}/v1/feedback", json=fb, headers={**setup.auth("a"), "Idempotency-Key": "fb-1"})
        f2 = httpx.post(f"{url}/v1/feedback", json=fb, headers={**setup.auth("a"), "Idempotency-Key": "fb-1"})
        assert f1.status_code == f2.status_code == 201 and f1.content == f2.content
        rec = httpx.get(f"{url}/v1/decisions/{fb['decision_id']}", headers=setup.auth("a")).json()
        assert len(rec["feedback"]) == 1
        # a key whose first request is still being decided: 409 (the writer paused mid-commit)
        held = sum(_in_flight(url, setup).values())
        assert held == 1  # tenant b's (the first one's feedback released it)
        writer = _app(srv).services.store._proc.pid
        os.kill(writer, signal.SIGSTOP)
        try:
            out: list[httpx.Response] = []
            t = threading.Thread(target=lambda: out.append(_route(url, setup, key="slow")))
            t.start()
            deadline = time.monotonic() + 10
            while sum(_in_flight(url, setup).values()) < held + 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sum(_in_flight(url, setup).values()) == held + 1  # decided, waiting for its commit
            pending = _route(url, setup, key="slow")
            assert pending.status_code == 409 and pending.json()["error"] == "conflict"
        finally:
            os.kill(writer, signal.SIGCONT)
        t.join(timeout=10)
        assert out[0].status_code == 200 and _route(url, setup, key="slow").content == out[0].content
    decisions = list(iter_decisions(setup.settings.db_path))
    assert len(decisions) == 3  # first, tenant b's, "slow": every retry booked nothing


def test_a_failure_after_the_decision_releases_its_reservation(tmp_path: Path) -> None:
    """The request is decided and reserved, then its commit fails (the log's writer dies while the
    request waits for it): 503 -- and since the batch was at the writer, its commit is in doubt: the
    key stays pending (a retry gets 409) until the log says the row is not there, then the
    reservation, this router's view and the key are freed."""
    setup = _setup(tmp_path)
    srv = ServerThread(create_app(setup.settings))
    with srv as url:
        svc = _app(srv).services
        assert _route(url, setup).status_code == 200  # one decision stays held throughout
        writer = svc.store._proc.pid
        os.kill(writer, signal.SIGSTOP)
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(_route(url, setup, key="k-503")))
        t.start()
        deadline = time.monotonic() + 10
        while sum(_in_flight(url, setup).values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(_in_flight(url, setup).values()) == 2 and int(svc.engine.env.inflight.sum()) == 2  # reserved
        os.kill(writer, signal.SIGKILL)
        t.join(timeout=15)
        assert out[0].status_code == 503 and out[0].json()["error"] == "unavailable"
        assert svc.state.core.claim("a:route:k-503", 1).status == "pending"  # in doubt, not decided anew
        deadline = time.monotonic() + 10
        while sum(_in_flight(url, setup).values()) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(_in_flight(url, setup).values()) == 1  # released once the log said it is not there
        assert int(svc.engine.env.inflight.sum()) == 1 and int(svc.engine.own_held.sum()) == 1
        assert svc.state.core.claim("a:route:k-503", 1).status == "new"  # the key was dropped


def test_a_restart_rebuilds_the_embedded_state_from_the_log(tmp_path: Path) -> None:
    """Five decisions, two with feedback, one under a key; the router stops and starts again on the
    same log: three reservations are held again (the others' work as this router now sees it), and
    the keyed request's retry gets its first answer and books nothing."""
    setup = _setup(tmp_path)
    srv = ServerThread(create_app(setup.settings))
    with srv as url:
        answers = [_route(url, setup, key="keyed" if i == 0 else None) for i in range(5)]
        assert all(a.status_code == 200 for a in answers)
        for a in answers[3:]:
            fb = {"decision_id": a.json()["decision_id"], "latency_ms": 500.0}
            assert httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
        before = _in_flight(url, setup)
        assert sum(before.values()) == 3
    srv = ServerThread(create_app(setup.settings))
    with srv as url:
        assert _in_flight(url, setup) == before
        retry = _route(url, setup, key="keyed")
        assert retry.status_code == 200 and retry.content == answers[0].content
        assert _in_flight(url, setup) == before
        engine = _app(srv).services.engine
        deadline = time.monotonic() + 5  # the shared view (refreshed every 50 ms): the rebuilt work is "others'"
        while int(engine.env.view_others.sum()) != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert int(engine.env.view_others.sum()) == 3 and int(engine.own_held.sum()) == 0
        # feedback after the restart releases a rebuilt reservation
        fb = {"decision_id": answers[1].json()["decision_id"], "latency_ms": 500.0}
        assert httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
        assert sum(_in_flight(url, setup).values()) == 2
    assert len(list(iter_decisions(setup.settings.db_path))) == 5


# ---------------------------------------------------------------------------------------- Redis
@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("fail_open", [False, True])
def test_a_redis_outage_answers_503_naming_the_state_and_recovers(tmp_path: Path, own_redis: RedisServer,
                                                                  fail_open: bool) -> None:
    setup = _setup(tmp_path, state_backend="redis", state_url=own_redis.url, state_timeout_s=0.3,
                   state_fail_open=fail_open, state_prefix=f"outage-{fail_open}")
    with ServerThread(create_app(setup.settings)) as url:
        ok = _route(url, setup)
        assert ok.status_code == 200
        assert httpx.get(f"{url}/readyz").json()["state"] == "ok"
        own_redis.stop()
        down = _route(url, setup)
        if fail_open:  # this router's own view answers (and may overcommit the pools: docs/router.md)
            assert down.status_code == 200
        else:
            assert down.status_code == 503 and down.headers["retry-after"] == "1"
            body = down.json()
            assert body["error"] == "state_unavailable" and own_redis.url in body["message"]
            assert body["request_id"] and "Traceback" not in down.text
            ready = httpx.get(f"{url}/readyz")
            assert ready.status_code == 503 and ready.json()["state"] == "down"
            fb = {"decision_id": ok.json()["decision_id"], "latency_ms": 10.0}
            stored = httpx.post(f"{url}/v1/feedback", json=fb, headers=setup.auth("a"))
            assert stored.status_code == 201  # feedback is stored; its release waits for the hold
        own_redis.start()  # back, empty (no persistence in the test server)
        if fail_open:
            time.sleep(1.1)  # failing open, the server is tried again a second after the last failure
        back = _route(url, setup)
        assert back.status_code == 200 and httpx.get(f"{url}/readyz").status_code == 200
        held = redis.Redis.from_url(own_redis.url).hget(f"outage-{fail_open}:{{router}}:held", back.json()["decision_id"])
        assert held is not None and held.decode().endswith(back.json()["offering"]["offering_id"])


def test_a_redis_that_restarts_empty_is_restored_from_every_routers_log(tmp_path: Path, own_redis: RedisServer) -> None:
    """Two routers with their own SQLite logs on one Redis; it restarts without persistence. Within
    a few seconds the in-flight work is back -- each router's held decisions, not those with
    feedback -- a keyed retry gets its first answer and books nothing, and decisions and feedback
    after the restart count as before."""
    setups = [_setup(tmp_path / name, state_backend="redis", state_url=own_redis.url, state_prefix="restart")
              for name in ("a", "b")]
    with ServerThread(create_app(setups[0].settings)) as url_a, ServerThread(create_app(setups[1].settings)) as url_b:
        urls = [url_a, url_b]
        # (keys differ: the routers share the idempotency keys as well)
        answers = {u: [retry_restoring(lambda: _route(u, st, key=f"keyed-{j}" if i == 0 else None))  # noqa: B023
                       for i in range(3)] for j, (u, st) in enumerate(zip(urls, setups))}
        assert all(a.status_code == 200 for got in answers.values() for a in got)
        fb = {"decision_id": answers[url_b][2].json()["decision_id"], "latency_ms": 400.0}
        assert httpx.post(f"{url_b}/v1/feedback", json=fb, headers=setups[1].auth("a")).status_code == 201
        before = _in_flight(url_a, setups[0])
        assert sum(before.values()) == 5 and _in_flight(url_b, setups[1]) == before

        own_redis.stop()
        own_redis.start()  # the same port, nothing kept
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if _in_flight(url_a, setups[0]) == before:
                    break
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.1)
        assert _in_flight(url_a, setups[0]) == before == _in_flight(url_b, setups[1])
        epoch = redis.Redis.from_url(own_redis.url).get("restart:{router}:epoch")
        assert epoch is not None
        for j, (u, st) in enumerate(zip(urls, setups)):
            retry = retry_restoring(lambda: _route(u, st, key=f"keyed-{j}"))  # noqa: B023 (called at once)
            assert retry.status_code == 200 and retry.content == answers[u][0].content
        assert _in_flight(url_a, setups[0]) == before
        after = _route(url_a, setups[0])  # a decision after the restart books as ever; feedback frees it
        assert after.status_code == 200 and sum(_in_flight(url_a, setups[0]).values()) == 6
        for a in (after, answers[url_a][1]):
            fb = {"decision_id": a.json()["decision_id"], "latency_ms": 400.0}
            assert httpx.post(f"{url_a}/v1/feedback", json=fb, headers=setups[0].auth("a")).status_code == 201
        assert sum(_in_flight(url_b, setups[1]).values()) == 4


def test_workers_need_a_shared_state(tmp_path: Path) -> None:
    """``--workers 2`` with the embedded state is refused with one line, before listening."""
    setup = make_setup(tmp_path)
    env = {**os.environ, "XROUTE_ROUTER_ENV__SERVING_CONFIG": str(tmp_path / "serving.yaml"),
           "XROUTE_ROUTER_CONFIG": str(tmp_path / "router.yaml")}
    def serve(workers: str) -> list[str]:
        res = subprocess.run([sys.executable, "-m", "xroute_app", "serve", "--workers", workers, "--telemetry",
                              str(tmp_path / "bundle"), "--db", str(setup.settings.db_path), "--port", str(free_port())],
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stdout == ""
        return res.stderr.strip().splitlines()

    lines = serve("2")
    assert len(lines) == 1 and lines[0].startswith("xroute: error: --workers 2: the embedded state")
    assert "state_backend: redis" in lines[0]
    assert serve("0") == ["xroute: error: --workers: must be from 1 to 256, got 0"]


#: every accelerator one slot per replica: pools of 1 or 2 slots, so concurrent requests contend
ONE_SLOT_SERVING = re.sub(r"tpot_growth: [\d.]+", "tpot_growth: 0.0", re.sub(r"max_concurrency: \d+", "max_concurrency: 1",
                                                                          SERVING_YAML))


@pytest.mark.slow
def test_router_processes_on_one_redis_never_admit_more_than_a_pools_capacity(tmp_path: Path,
                                                                               own_redis: RedisServer) -> None:
    """Two ``xroute serve`` -- one with ``--workers 2`` -- on one real Redis, hammered by 16 clients
    that hold each answer a few ms and then report it: the intervals from each answer to its
    feedback (inside the reservation's) never overlap beyond a pool's capacity, each answer's
    reservation is the shared state's (its pool, under its decision id, when the answer arrives),
    and once everything is reported nothing is left in flight or expired."""
    setup = make_setup(tmp_path, state_backend="redis", state_url=own_redis.url)
    (tmp_path / "serving.yaml").write_text(ONE_SLOT_SERVING)
    prefix = "hammer"
    env = {"XROUTE_ROUTER_ENV__SERVING_CONFIG": str(tmp_path / "serving.yaml"),
           "XROUTE_ROUTER_ENV__QUEUE_TIMEOUT_S": "0.001",  # capacity = slots: no queue
           "XROUTE_ROUTER_CONFIG": str(tmp_path / "router.yaml"), "XROUTE_ROUTER_STATE_BACKEND": "redis",
           "XROUTE_ROUTER_STATE_URL": own_redis.url, "XROUTE_ROUTER_STATE_PREFIX": prefix,
           "XROUTE_ROUTER_STATE_HOLD_FLOOR_S": "120", "XROUTE_ROUTER_REPLAY_SPEED": "1e-6"}
    args = ["--telemetry", str(tmp_path / "bundle"), "--db", str(tmp_path / "decisions.db"),
            "--keys-file", str(tmp_path / "keys.json"), "--model", "", "--log-level", "WARNING"]
    ports = [free_port(), free_port()]
    procs = [start_subprocess([*args, "--workers", "2"], env, ports[0], tmp_path / "a.log"),
             start_subprocess(args, env, ports[1], tmp_path / "b.log")]
    r = redis.Redis.from_url(own_redis.url)
    held_key = f"{prefix}:{{router}}:held"
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        info = httpx.get(f"{urls[1]}/v1/offerings", headers=setup.auth("a"), timeout=10).json()
        model = info["models"][0]
        slots = {pool_key(model, o["offering"]["offering_id"]): o["slots"] for o in info["offerings"]}
        intervals: list[tuple[str, float, float]] = []
        mismatches: list[str] = []
        codes: dict[int, int] = {}
        per_url = [0, 0]
        lock = threading.Lock()
        end = time.monotonic() + 8.0

        def client(k: int) -> None:
            rng = random.Random(k)
            u = k % 2
            with httpx.Client(base_url=urls[u], timeout=10) as c:
                while time.monotonic() < end:
                    res = c.post("/v1/route", json={**ROUTE, "origin": info["origins"][k % len(info["origins"])]},
                                 headers=setup.auth("a"))
                    with lock:
                        codes[res.status_code] = codes.get(res.status_code, 0) + 1
                    if res.status_code != 200:
                        time.sleep(rng.random() * 0.005)
                        continue
                    t0 = time.monotonic()
                    d = res.json()
                    pool = pool_key(model, d["offering"]["offering_id"])
                    got = r.hget(held_key, d["decision_id"])
                    if got is None or got.decode() != f"1:{pool}":
                        with lock:
                            mismatches.append(f"{d['decision_id']}: {got!r} vs {pool}")
                    time.sleep(rng.random() * 0.01)
                    t1 = time.monotonic()
                    fb = c.post("/v1/feedback", json={"decision_id": d["decision_id"], "latency_ms": 10.0},
                                headers=setup.auth("a"))
                    assert fb.status_code == 201, fb.text
                    with lock:
                        intervals.append((pool, t0, t1))
                        per_url[u] += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not mismatches, mismatches[:5]
        assert set(codes) <= {200, 429}, codes
        assert len(intervals) > 200 and codes.get(429, 0) > 0, (len(intervals), codes)  # real contention
        assert min(per_url) > 50, per_url  # both routers decided
        filled = 0
        for pool, capacity in slots.items():
            edges = sorted([(t0, 1) for p, t0, _ in intervals if p == pool]
                           + [(t1, -1) for p, _, t1 in intervals if p == pool])
            level = most = 0
            for _, step in edges:
                level += step
                most = max(most, level)
            assert most <= capacity, (pool, most, capacity)
            filled += most == capacity > 0
        assert filled >= 1  # some pool was filled, not merely never reached
        status = httpx.get(f"{urls[0]}/v1/admin/status", headers=setup.auth("admin")).json()["state"]
        assert status["in_flight"] == {} and sum(status["expired"].values()) == 0
        assert r.hlen(held_key) == 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    decisions = list(iter_decisions(tmp_path / "decisions.db"))
    assert len(decisions) == len(intervals)  # every answered decision is in the one log, once
    assert all(json.loads(d["request_json"])["origin"] in info["origins"] for d in decisions)
