"""The router's start (``router.core.startup``, ``docs/router.md``, "Start time"): the phases each start
logs, the cyclic GC held off and given back, and readiness that is honest -- the first ``/readyz``
200 of a real ``xroute serve`` (one worker, and two on the Redis state) is followed at once by a
``/v1/route`` the configured model decides. (How long a start takes is measured by
``benchmarks/bench_startup.py``, not asserted here.)"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from router.core import startup
from tests.servers import REPO_ROOT, RedisServer, free_port
from tests.test_router_support import ROUTE, RouterSetup, make_setup

#: the phases a start of ``xroute serve`` marks, in order (one worker: the engine before the server;
#: a worker of several: the engine inside the app's lifespan)
ONE_WORKER = ["imports", "settings", "kernels", "telemetry", "environment", "engine", "checks", "server",
              "decision_log", "policy_store", "gc", "model", "state", "services"]
A_WORKER = ["imports", "settings", "server", "kernels", "telemetry", "environment", "engine", "decision_log",
            "policy_store", "gc", "model", "state", "services"]


def test_the_clock_counts_from_the_process_start_and_adds_up_its_phases() -> None:
    age = startup.process_age_s()
    assert age is not None and 0 < age < 3600  # this test process started before the test, not before boot
    clock = startup.StartClock()
    first = clock.mark("a")
    assert first >= age * 0.99  # the first phase runs from the process's start
    time.sleep(0.02)
    clock.mark("b")
    clock.skip()
    time.sleep(0.01)
    clock.mark("b")  # a phase marked twice adds up
    report = clock.report()
    assert list(report["start_s"]) == ["a", "b"]
    assert 0.03 <= report["start_s"]["b"] < 1.0
    assert report["started_in_s"] >= sum(report["start_s"].values()) - 0.002


class _Node:
    other: _Node | None = None


def test_the_collector_is_held_for_the_start_and_given_back_with_everything_frozen() -> None:
    """Held: nothing collects. The imports frozen; what the start built collected (a cycle made
    then is freed) and the rest frozen; at the end the rest frozen too and the collector back on."""
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        startup.hold_gc()
        assert not gc.isenabled()
        startup.freeze_imports()
        after_imports = gc.get_freeze_count()
        assert after_imports > frozen
        kept = [_Node() for _ in range(1000)]  # what the start built and keeps
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle, unreachable once dropped: only the collector frees it
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # (nothing collects while held)
        startup.settle_gc()
        assert gone() is None  # collected
        settled = gc.get_freeze_count()
        assert settled >= after_imports + len(kept) and not gc.isenabled()  # the rest frozen, still held
        later = [_Node() for _ in range(100)]  # the model's load
        startup.release_gc()
        assert gc.isenabled() and gc.get_freeze_count() >= settled + len(later)
        startup.release_gc(only_if_held=True)  # nothing held any more: nothing done
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def _model(tmp: Path) -> Path:
    """A learned router exported to a directory (no registry: its path is the model URI)."""
    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
    from models.policy import RouterWeights, save_router

    rng = np.random.default_rng(0)
    d_in, ctx = N_OFFERING_FEATURES + N_REQUEST_FEATURES, 4
    w = RouterWeights(layers=[(rng.normal(size=(d_in + ctx, 8)).astype(np.float32), np.zeros(8, np.float32)),
                              (rng.normal(size=(8, 1)).astype(np.float32), np.zeros(1, np.float32))],
                      ctx=(rng.normal(size=(d_in, ctx)).astype(np.float32), np.zeros(ctx, np.float32)))
    return save_router(w, tmp / "export")


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


def _start_and_route(setup: RouterSetup, tmp: Path, workers: int, env: dict[str, str]) -> tuple[Any, list[dict[str, Any]]]:
    """Spawn ``xroute serve``, poll ``/readyz`` until its first 200 and send one ``/v1/route`` at
    once; returns that answer and the router's log lines."""
    port = free_port()
    log = tmp / f"serve-w{workers}.log"
    args = [sys.executable, "-m", "xroute_app", "serve", "--port", str(port), "--telemetry", str(tmp / "bundle"),
            "--db", str(tmp / f"decisions-w{workers}.db"), "--keys-file", str(tmp / "keys.json"), "--model",
            str(_model(tmp)), "--log-level", "INFO", "--workers", str(workers)]
    full_env = {**os.environ, "XROUTE_ROUTER_ENV__SERVING_CONFIG": str(tmp / "serving.yaml"),
                "XROUTE_ROUTER_CONFIG": str(tmp / "router.yaml"), **env}
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    r = client.get("/readyz", timeout=0.5)
                except httpx.HTTPError:
                    time.sleep(0.02)
                    continue
                if r.status_code == 200:
                    break
            answer = client.post("/v1/route", json=ROUTE, headers=setup.auth("a"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    return answer, lines


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_the_first_ready_is_followed_by_a_decision_of_the_model_and_the_start_says_what_it_spent(
        workers: int, tmp_path: Path, redis: RedisServer) -> None:
    """The first 200 of ``/readyz`` means the router can decide as configured: the ``/v1/route``
    sent right after it is answered 200 by the model (not the fallback, not a 503). Each serving
    process logs its start's phases with ``router ready``, in order, adding up to no more than the
    time since the process started."""
    env = ({"XROUTE_ROUTER_STATE_BACKEND": "redis", "XROUTE_ROUTER_STATE_URL": redis.url,
            "XROUTE_ROUTER_STATE_PREFIX": "startup"} if workers > 1 else {})
    setup = make_setup(tmp_path)
    answer, lines = _start_and_route(setup, tmp_path, workers, env)
    assert answer.status_code == 200, answer.text
    assert answer.json()["policy"]["kind"] == "model" and answer.json()["score_kind"] == "q_value"
    ready = [x for x in lines if x.get("msg") == "router ready"]
    assert len(ready) == workers, lines[-10:]
    for line in ready:
        phases = line["start_s"]
        assert list(phases) == (ONE_WORKER if workers == 1 else A_WORKER)
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) <= line["started_in_s"] + 0.01
        assert line["policy"] != "greedy"  # the model was in place before ready


def test_a_router_serves_once_its_decision_log_can_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SQLite decision log commits in a spawned interpreter (``router.store.sqlite``); here one
    that takes 4 s to start (a ``sitecustomize`` that sleeps: a loaded machine's slow start, made
    certain). The router's start waits for it, so its first decision is answered at once. Before,
    the start did not wait, and the first decision of a router waited out its writer's start (seen
    on a loaded machine as a dispatch seconds late: router 2's first decision in
    ``test_admission.py``'s two-routers test)."""
    from router.app.factory import create_app
    from tests.servers import ServerThread

    slow = tmp_path / "slow_site"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(4.0)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")]))
    setup = make_setup(tmp_path / "r")
    t0 = time.monotonic()
    with ServerThread(create_app(setup.settings)) as url:
        started = time.monotonic() - t0
        t1 = time.monotonic()
        r = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=30)
        took = time.monotonic() - t1
    assert r.status_code == 200, r.text
    assert took < 2.0, f"the first decision took {took:.2f} s (started after {started:.2f} s): it waited for the writer"
    assert started >= 4.0, started  # the start waited for the writer
