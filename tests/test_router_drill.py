"""Issue 21's drill, one test per fault it found, against real servers: ``xroute serve --workers 2``
as a subprocess on a real PostgreSQL log and a real redis-server (and, where a fault is between
routers, two routers in this process with their own SQLite logs).

1. a keyed retry sent while a Redis that came back empty is being restored gets its first answer
   or a 503, never a second decision -- on one router, and across routers whose logs differ;
2. ``/readyz`` follows PostgreSQL within two seconds without a request failing first;
3. the first routes after PostgreSQL came back while the router was idle are answered;
4. killing the ``xroute serve`` supervisor (SIGKILL) takes its workers, their log writers and the
   resource tracker with it, and frees the port;
5. a body that is not UTF-8 is the same 422 on every route, and no route documents or answers a 400;
6. integer fields accept what the published schema calls an integer and nothing else;
7. every line the router writes on stderr is JSON, outages included.

The whole module is the slow tier (router subprocesses, a PostgreSQL stopped and started)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psycopg
import pytest

from router.app.factory import create_app
from tests.servers import (
    REPO_ROOT,
    PostgresServer,
    RedisServer,
    ServerThread,
    alive,
    descendants,
    free_port,
    port_free,
    start_subprocess,
)
from tests.test_router_support import ROUTE, RouterSetup, make_setup, retry_restoring

pytestmark = pytest.mark.slow


@dataclass
class Served:
    """An ``xroute serve`` subprocess: its port, URL, combined stdout/stderr log, keys, decision log."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    setup: RouterSetup
    db: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(tmp: Path, db: str, redis_url: str, prefix: str, workers: int = 2, **env: str) -> Served:
    """``xroute serve --workers N`` on the tiny bundle with the Redis state and the decision log ``db``."""
    setup = make_setup(tmp, state_backend="redis", state_url=redis_url)
    environment = {"XROUTE_ROUTER_ENV__SERVING_CONFIG": str(tmp / "serving.yaml"),
                   "XROUTE_ROUTER_CONFIG": str(tmp / "router.yaml"), "XROUTE_ROUTER_STATE_BACKEND": "redis",
                   "XROUTE_ROUTER_STATE_URL": redis_url, "XROUTE_ROUTER_STATE_PREFIX": prefix, **env}
    args = ["--telemetry", str(tmp / "bundle"), "--db", db, "--keys-file", str(tmp / "keys.json"), "--model", "",
            "--log-level", "INFO", "--workers", str(workers)]
    port = free_port()
    log = tmp / "router.log"
    return Served(start_subprocess(args, environment, port, log), port, log, setup, db)


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    """This module's own PostgreSQL (its tests stop and start it)."""
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def drill(pg: PostgresServer, redis_srv: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Two workers on a PostgreSQL log and the Redis state, as the drill ran them."""
    url = pg.create_database("drill")
    served = serve(tmp_path_factory.mktemp("drill"), url, redis_srv.url, "drill")
    try:
        yield served
    finally:
        served.stop()


def _route(url: str, setup: RouterSetup, key: str | None = None, **body: Any) -> httpx.Response:
    """One request on a connection of its own (so the kernel hands it to either worker)."""
    headers = {**setup.auth("a"), **({"Idempotency-Key": key} if key is not None else {})}
    return httpx.post(f"{url}/v1/route", json={**ROUTE, **body}, headers=headers, timeout=10)


def _keyed(url: str, setup: RouterSetup, key: str, **body: Any) -> httpx.Response:
    return retry_restoring(lambda: _route(url, setup, key, **body))  # type: ignore[no-any-return]


def _feedback(url: str, setup: RouterSetup, decision_id: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/feedback", json={"decision_id": decision_id, "latency_ms": 50.0},
                      headers=setup.auth("a"), timeout=10)


def _documented_503(r: httpx.Response) -> None:
    """A 503 as documented: Retry-After, the JSON error shape."""
    assert r.status_code == 503, r.text
    body = r.json()
    assert int(r.headers["retry-after"]) >= 1 and body["error"] and body["message"] and body["request_id"]


def _duplicate_keys(db_url: str) -> list[tuple[str, int]]:
    with psycopg.connect(db_url, connect_timeout=10) as conn:
        return conn.execute("SELECT idempotency_key, count(*) FROM decisions WHERE idempotency_key IS NOT NULL "
                            "GROUP BY idempotency_key HAVING count(*) > 1").fetchall()


def _hammer(send: Any, keys: list[str], until: float, threads: int = 4) -> list[tuple[float, str, httpx.Response]]:
    """``send(key)`` for every key, over and over from ``threads`` threads until ``until``."""
    out: list[tuple[float, str, httpx.Response]] = []
    lock = threading.Lock()

    def run(mine: list[str]) -> None:
        while time.monotonic() < until:
            for key in mine:
                try:
                    r = send(key)
                except httpx.HTTPError:
                    continue
                with lock:
                    out.append((time.monotonic(), key, r))

    workers = [threading.Thread(target=run, args=(keys[i::threads],)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return out


# ---------------------------------------------------------------------------------------- 1
def test_keyed_retries_after_redis_restarts_empty_get_their_first_answer_or_a_503(drill: Served,
                                                                                  redis_srv: RedisServer) -> None:
    """Keys decided, Redis SIGKILLed and started again empty, then every key retried from four
    threads for four seconds from the moment it is back: each retry gets the first answer's bytes
    or a documented 503 -- none a new decision -- and every key is answered again within the run."""
    first: dict[str, bytes] = {}
    for i in range(12):
        r = _keyed(drill.url, drill.setup, f"one-{i}")
        assert r.status_code == 200, r.text
        first[f"one-{i}"] = r.content
        assert _feedback(drill.url, drill.setup, r.json()["decision_id"]).status_code == 201
    redis_srv.kill()
    redis_srv.start()  # the same port, empty
    back = time.monotonic()
    got = _hammer(lambda k: _route(drill.url, drill.setup, key=k), list(first), back + 4.0)
    anew = [(round(t - back, 3), k) for t, k, r in got if r.status_code == 200 and r.content != first[k]]
    assert not anew, f"decided anew after the restart (s after it, key): {anew}"
    for _, _, r in got:
        if r.status_code != 200:
            _documented_503(r)
    answered = {k for t, k, r in got if r.status_code == 200 and t > back + 3.0}
    assert answered == set(first), set(first) - answered  # restored: answered again, the same bytes
    assert _duplicate_keys(drill.db) == []


def test_a_key_decided_by_another_router_is_not_decided_anew_while_that_router_restores(
        tmp_path: Path, redis_srv: RedisServer) -> None:
    """Two routers on their own SQLite logs (each log restored by its own router only): keys decided
    at B are retried at A from the moment Redis is back empty. A must not decide them before B has
    put them back -- 503 until then, B's first answer after."""
    setups = [make_setup(tmp_path / n, state_backend="redis", state_url=redis_srv.url, state_prefix="cross",
                         replay_speed=1e-6, env={"serving_config": str(tmp_path / n / "serving.yaml")})
              for n in ("a", "b")]
    with ServerThread(create_app(setups[0].settings)) as url_a, ServerThread(create_app(setups[1].settings)) as url_b:
        first = {}
        for i in range(8):
            r = _keyed(url_b, setups[1], f"cross-{i}")
            assert r.status_code == 200, r.text
            first[f"cross-{i}"] = r.content
        redis_srv.kill()
        redis_srv.start()
        back = time.monotonic()
        got = _hammer(lambda k: _route(url_a, setups[0], key=k), list(first), back + 4.0, threads=2)
        anew = [(round(t - back, 3), k) for t, k, r in got if r.status_code == 200 and r.content != first[k]]
        assert not anew, f"A decided B's keys anew (s after the restart, key): {anew}"
        for _, _, r in got:
            if r.status_code != 200:
                _documented_503(r)
        assert {k for t, k, r in got if r.status_code == 200 and t > back + 3.0} == set(first)


# ---------------------------------------------------------------------------------------- 2, 3
def _readiness(url: str, until: float) -> list[tuple[float, int]]:
    """``/readyz`` every 50 ms, each on a connection of its own (either worker answers)."""
    out = []
    while time.monotonic() < until:
        try:
            out.append((time.monotonic(), httpx.get(f"{url}/readyz", timeout=5).status_code))
        except httpx.HTTPError:
            out.append((time.monotonic(), 0))
        time.sleep(0.05)
    return out


def _flip(samples: list[tuple[float, int]], since: float, status: int) -> float:
    """Seconds from ``since`` until every sample has ``status`` (each worker probes on its own, so
    for a moment one may have flipped and the other not); at least the last 20 samples (a second)
    must have it: flipped for good, on both workers."""
    settled = len(samples)
    while settled > 0 and samples[settled - 1][1] == status:
        settled -= 1
    assert len(samples) - settled >= 20, f"readiness not {status} for good: {[s for _, s in samples]}"
    return max(0.0, samples[settled][0] - since)


def test_readiness_follows_postgres_without_traffic(drill: Served, pg: PostgresServer) -> None:
    """No requests: PostgreSQL stopped (immediate) -- every probe 503 within 2 s, on both workers; back
    (``pg_ctl start -w`` returned) -- every probe 200 within 2 s."""
    assert httpx.get(f"{drill.url}/readyz", timeout=5).status_code == 200
    t0 = time.monotonic()
    pg.stop("immediate")
    try:
        down = _flip(_readiness(drill.url, t0 + 4.0), t0, 503)
    finally:
        pg.start()  # (returns once the server accepts connections: crash recovery, after -m immediate)
    t1 = time.monotonic()
    up = _flip(_readiness(drill.url, t1 + 4.0), t1, 200)
    print(f"\nreadiness: 503 {down:.2f} s after PostgreSQL stopped, 200 {up:.2f} s after it was back")
    assert down <= 2.0 and up <= 2.0, (down, up)
    body = httpx.get(f"{drill.url}/readyz", timeout=5).json()
    assert body["decision_log"] == "ok" and body["state"] == "ok"


def test_the_first_routes_after_postgres_returns_to_an_idle_router_are_answered(drill: Served,
                                                                                pg: PostgresServer) -> None:
    """PostgreSQL restarted while no request came; two seconds later each worker's first routes
    commit on a connection of its own: all 200."""
    assert _route(drill.url, drill.setup).status_code == 200
    pg.stop("immediate")
    pg.start()
    time.sleep(2.0)
    codes = []
    for _ in range(16):
        r = _route(drill.url, drill.setup)
        codes.append(r.status_code)
        if r.status_code == 200:  # (released, so the pools never fill)
            _feedback(drill.url, drill.setup, r.json()["decision_id"])
    assert codes == [200] * 16, codes


class CuttingProxy:
    """A TCP proxy on loopback in front of PostgreSQL that, once armed, loses the answer to the next
    ``COMMIT`` that went through: the server has committed, the client sees its connection drop --
    the commit in doubt that a real outage produces at random (found by the chaos test: two
    decisions under one key when ``pg_ctl stop -m immediate`` fell between a COMMIT and its answer)."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_server and self.armed.is_set() and b"COMMIT\x00" in data:  # CommandComplete "COMMIT"
                    self.armed.clear()
                    self.cut.set()
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_keyed_request_whose_commit_is_in_doubt_is_answered_once(pg: PostgresServer, tmp_path: Path) -> None:
    """The answer to a COMMIT is lost (the row is in the log, the router's connection drops): the
    request gets a 503, its retries 409 while the router asks the log, then the answer it missed --
    the same decision, one row -- for a route and for a feedback alike; never a second row."""
    db = pg.create_database("doubt")
    proxy = CuttingProxy(pg.port)
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:*:*:{pg.USER}:{pg.password}\n")
    passfile.chmod(0o600)
    via_proxy = f"postgresql://{pg.USER}@127.0.0.1:{proxy.port}/doubt?passfile={passfile}"
    setup = make_setup(tmp_path, db_url=via_proxy, replay_speed=1e-6, env={"serving_config": str(tmp_path / "serving.yaml")})
    try:
        with ServerThread(create_app(setup.settings)) as url:
            assert _route(url, setup, "before").status_code == 200
            proxy.armed.set()
            lost = _route(url, setup, "doubt")
            assert proxy.cut.is_set() and lost.status_code == 503 and lost.json()["error"] == "unavailable"
            assert _route(url, setup, "doubt").status_code == 409  # in doubt: pending, not decided anew
            time.sleep(2.0)
            again = _route(url, setup, "doubt")
            assert again.status_code == 200, again.text
            decision = again.json()["decision_id"]
            assert _route(url, setup, "doubt").content == again.content

            proxy.cut.clear()
            proxy.armed.set()
            fb = {"decision_id": decision, "latency_ms": 30.0}
            headers = {**setup.auth("a"), "Idempotency-Key": "fb-doubt"}
            lost = httpx.post(f"{url}/v1/feedback", json=fb, headers=headers, timeout=10)
            assert proxy.cut.is_set() and lost.status_code == 503
            assert httpx.post(f"{url}/v1/feedback", json=fb, headers=headers, timeout=10).status_code == 409
            time.sleep(2.0)
            stored = httpx.post(f"{url}/v1/feedback", json=fb, headers=headers, timeout=10)
            assert stored.status_code == 201, stored.text
        with psycopg.connect(db, connect_timeout=10) as conn:
            rows = conn.execute("SELECT decision_id FROM decisions WHERE idempotency_key = 'a:route:doubt'").fetchall()
            assert rows == [(decision,)]  # the lost answer's decision, once
            fbs = conn.execute("SELECT feedback_id FROM feedback WHERE idempotency_key = 'a:feedback:fb-doubt'").fetchall()
            assert fbs == [(stored.json()["feedback_id"],)]
    finally:
        proxy.close()


# ---------------------------------------------------------------------------------------- 4
def test_killing_the_supervisor_takes_its_workers_writers_and_tracker_with_it(tmp_path: Path,
                                                                              redis_srv: RedisServer) -> None:
    """SIGKILL of the ``xroute serve --workers 2`` parent: within 5 s every process below it is gone
    (the workers, their SQLite writer processes, multiprocessing's resource tracker), nothing
    answers, and the port is free for the next ``xroute serve``."""
    served = serve(tmp_path, str(tmp_path / "decisions.db"), redis_srv.url, "orphans")
    tree: set[int] = set()
    try:
        assert _route(served.url, served.setup).status_code == 200
        deadline = time.monotonic() + 60  # (ready once one worker is: the other may still be starting)
        while len(tree := descendants(served.proc.pid)) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(tree) >= 5, tree  # two workers, their two writers, the resource tracker
        served.proc.kill()
        served.proc.wait()
        killed = time.monotonic()
        while time.monotonic() < killed + 5.0:
            if not any(alive(p) for p in tree) and port_free(served.port):
                break
            time.sleep(0.05)
        left = sorted(p for p in tree if alive(p))
        assert not left, [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for p in left]
        assert port_free(served.port)
        print(f"\nsupervisor SIGKILLed: its {len(tree)} processes gone and the port free in "
              f"{time.monotonic() - killed:.2f} s")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{served.url}/healthz", timeout=2)
    finally:  # (this test's own processes only, should it fail: never leave them running)
        for p in tree | (descendants(served.proc.pid) if served.proc.poll() is None else set()):
            if alive(p) and str(REPO_ROOT) in Path(f"/proc/{p}/cmdline").read_text(errors="replace"):
                os.kill(p, signal.SIGKILL)
        served.stop()


# ---------------------------------------------------------------------------------------- 5, 6
def test_a_body_that_is_not_utf8_is_the_same_422_on_every_route(drill: Served) -> None:
    """Every route that takes a body answers one that is not UTF-8 with a 422 on ``body`` (never
    FastAPI's bare 400) and documents it; the router's API in its error shape, the OpenAI-compatible
    gateway's routes in OpenAI's (``docs/gateway.md``)."""
    spec = httpx.get(f"{drill.url}/openapi.json", timeout=10).json()
    with_body = [(path, method) for path, ops in spec["paths"].items() for method, op in ops.items()
                 if "requestBody" in op]
    assert ("/v1/route", "post") in with_body and ("/v1/feedback", "post") in with_body
    headers = {**drill.setup.auth("a"), "content-type": "application/json"}
    for path, method in with_body:
        responses = spec["paths"][path][method]["responses"]
        gateway = path in ("/v1/chat/completions", "/v1/completions")
        assert "400" not in responses and "422" in responses, (path, responses)
        if not gateway:
            assert "UTF-8" in responses["422"]["description"], (path, responses)
        for raw in (b"\xff", b'{"decision_id": "d_\xff"}', b"{"):
            r = httpx.request(method.upper(), f"{drill.url}{path}", content=raw, headers=headers, timeout=10)
            assert r.status_code == 422, (path, raw, r.status_code, r.text)
            body = r.json()
            if gateway:
                assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "body", body
                continue
            assert body["error"] == "invalid_request" and body["fields"][0]["field"] == "body" and body["request_id"]
            if raw != b"{":
                assert "UTF-8" in body["fields"][0]["message"], body


def test_integer_fields_take_what_the_published_schema_calls_an_integer(drill: Served) -> None:
    """For each integer field, values of every JSON type: the server accepts exactly those the
    served OpenAPI document's schema accepts (JSON Schema 2020-12: 12 and 12.0 are the same integer;
    "12", true and 12.5 are not integers)."""
    spec = httpx.get(f"{drill.url}/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    assert schemas["RouteRequest"]["properties"]["input_tokens"]["type"] == "integer"
    decision = _route(drill.url, drill.setup).json()["decision_id"]
    cases = [("/v1/route", "RouteRequest", {**ROUTE}, ["input_tokens", "max_output_tokens"]),
             ("/v1/feedback", "FeedbackRequest", {"decision_id": decision, "latency_ms": 10.0}, ["output_tokens"])]
    checked = 0
    for path, name, base, fields in cases:
        validator = jsonschema.Draft202012Validator({**schemas[name], "components": spec["components"]})
        for field in fields:
            for value in (12, 12.0, "12", True, 12.5, None, [12], 1e400):
                body = json.dumps({**base, field: value}).replace("Infinity", "1e400").encode()
                valid = validator.is_valid({**base, field: value}) if value != 1e400 else False
                r = httpx.post(f"{drill.url}{path}", content=body, timeout=10,
                               headers={**drill.setup.auth("a"), "content-type": "application/json"})
                assert r.status_code in (200, 201, 422, 429), r.text  # (429: valid, the pools full)
                if r.status_code == 200:
                    _feedback(drill.url, drill.setup, r.json()["decision_id"])
                assert (r.status_code != 422) == valid, (path, field, value, r.status_code, r.text)
                if not valid:
                    assert r.json()["fields"][0]["field"] == f"body.{field}", r.text
                checked += 1
    assert checked == 24


# ---------------------------------------------------------------------------------------- 7
def test_every_line_the_router_wrote_is_json(drill: Served) -> None:
    """After the outages above (Redis killed, PostgreSQL stopped twice, requests failing): the
    supervisor's and the workers' output, every line a JSON object."""
    lines = [x for x in drill.log.read_text(errors="replace").splitlines() if x.strip()]
    assert len(lines) > 20
    bad = []
    for line in lines:
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            bad.append(line[:200])
    assert not bad, bad[:10]
    loggers = {json.loads(x)["logger"] for x in lines}
    assert "uvicorn.error" in loggers and "xroute.router" in loggers
