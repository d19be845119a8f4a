"""``POST /v1/route`` on the wire: raw HTTP over raw sockets to a real server on a loopback port.

The route is a plain FastAPI route behind the app's ASGI middleware: pipelined answers come back
in order, ``Connection: close`` and HTTP/1.0 are honoured, full pools answer 429, a dead decision
log 503, every request gets its access line and error count, a body that arrives in pieces is
answered, a graceful shutdown lets an answer waiting for its commit go out, and a middleware added
with ``add_middleware`` sees the route like any other. The replay runs at 1e-6 telemetry seconds
per second, so the pools' load only comes from the requests sent here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.app.factory import create_app
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, LogCapture, RouterSetup, make_setup

ONE_POOL = {"allow": [{"offering_ids": ["gcp:europe-west4:g2-standard-4:on_demand"]}]}
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _setup(tmp: Path) -> RouterSetup:
    return make_setup(tmp, log_level="INFO", replay_speed=1e-6, max_body_bytes=4096,
                      env={"serving_config": str(tmp / "serving.yaml"), "queue_timeout_s": 0.5},
                      tenants={"b": {"constraints": {"deny": [{"pricing_modes": ["spot"]}]}}})


@pytest.fixture(scope="module")
def logs() -> Iterator[LogCapture]:
    capture = LogCapture().attach()
    try:
        yield capture
    finally:
        capture.detach()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, logs: LogCapture) -> Iterator[tuple[ServerThread, RouterSetup]]:
    setup = _setup(tmp_path_factory.mktemp("wire"))
    srv = ServerThread(create_app(setup.settings))
    logs.attach()  # (again: create_app sets the router's own handler)
    with srv:
        yield srv, setup


def _request(setup: RouterSetup, body: bytes | dict[str, Any], who: str = "a", method: str = "POST",
             path: str = "/v1/route", version: str = "1.1", headers: dict[str, str] | None = None) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(raw)), **setup.auth(who),
            **(headers or {})}
    return (f"{method} {path} HTTP/{version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items() if v is not None)
            + "\r\n").encode() + raw


def _exchange(port: int, data: bytes, answers: int = 1) -> list[bytes]:
    """Send ``data`` on a new connection; read ``answers`` complete responses (by Content-Length)."""
    out: list[bytes] = []
    buf = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        while len(out) < answers:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                length = int(re.search(rb"(?im)^content-length: *(\d+)", buf[:end]).group(1))  # type: ignore[union-attr]
                if len(buf) >= end + 4 + length:
                    out.append(buf[: end + 4 + length])
                    buf = buf[end + 4 + length:]
                    continue
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        if out and b"connection: close" in out[-1].split(b"\r\n\r\n")[0]:
            assert s.recv(1) == b""  # and the server closed the connection
    assert len(out) == answers, out
    return out


def _one(server: tuple[ServerThread, RouterSetup], make: Any, answers: int = 1) -> list[bytes]:
    srv, setup = server
    return _exchange(srv.port, make(setup), answers)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ")[1])


def _head(answer: bytes) -> bytes:
    return answer.partition(b"\r\n\r\n")[0] + b"\r\n"


def _json(answer: bytes) -> dict[str, Any]:
    return json.loads(answer.partition(b"\r\n\r\n")[2])  # type: ignore[no-any-return]


def test_answers_and_errors_on_the_wire(server: Any) -> None:
    """Each request as raw HTTP: its status, the request id and trace echoed, the body an answer
    or the JSON error naming what is wrong; HTTP/1.0 and ``Connection: close`` close after the answer."""
    cases: list[tuple[Any, int, bytes | None]] = [
        (lambda s: _request(s, ROUTE, headers={"X-Request-ID": "req-1", "traceparent": TRACE.upper()}), 200, None),
        (lambda s: _request(s, {**ROUTE, "session_id": "s-\u00e9", "constraints": {"pricing_mode": "spot"}}), 422,
         b"body.constraints.pricing_mode"),
        (lambda s: _request(s, ROUTE, who="b"), 200, None),  # the tenant's constraints
        (lambda s: _request(s, ROUTE, headers={"Authorization": None, "X-API-Key": s.keys["a"]}), 200, None),
        (lambda s: _request(s, ROUTE, headers={"Content-Type": "application/json; charset=utf-8"}), 200, None),
        (lambda s: _request(s, {**ROUTE, "origin": "aws:us-eats-1"}), 422, b'"unknown_origin"'),
        (lambda s: _request(s, {**ROUTE, "constraints": {"allow": [{"regions": ["japaneast"]}],
                                                         "deny": [{"regions": ["japaneast"]}]}}), 422, b"body.constraints"),
        (lambda s: _request(s, {**ROUTE, "constraints": {"allow": [{"instance_types": ["g5.xlarg"]}]}}), 422,
         b"g5.xlarge"),
        (lambda s: _request(s, {**ROUTE, "ttft_ms": 0}), 422, b"body.ttft_ms"),
        (lambda s: _request(s, b'{"origin": '), 422, b'"field":"body"'),
        (lambda s: _request(s, b""), 422, b'"field":"body"'),
        (lambda s: _request(s, ROUTE, headers={"Authorization": "Bearer xr_00000000_nope"}), 401, b'"unauthorized"'),
        (lambda s: _request(s, {**ROUTE, "session_id": "x" * 5000}), 413, b'"payload_too_large"'),
        (lambda s: _request(s, ROUTE, headers={"Content-Type": "text/plain"}), 422, b"Content-Type: application/json"),
        (lambda s: _request(s, ROUTE, version="1.0"), 200, None),  # HTTP/1.0: answered, then closed
        (lambda s: _request(s, ROUTE, headers={"Connection": "close", "X-Request-ID": "bad id!"}), 200, None),
    ]
    for make, status, needle in cases:
        got = _one(server, make)[0]
        assert _status(got) == status, got
        if needle is not None:
            assert needle in got, got
        if status == 200:
            assert _json(got)["decision_id"].startswith("d_")
        else:
            assert set(_json(got)) >= {"error", "message", "fields", "request_id"}
    first = _one(server, cases[0][0])[0]
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-request-id: req-1\r\n" in first
    assert f"traceparent: {TRACE}\r\n".encode() in first
    closed = _one(server, cases[-1][0])[0]  # a bad request id is replaced; the connection closed (_exchange)
    assert re.search(rb"x-request-id: [0-9a-f]{16}\r\n", closed) and b"connection: close\r\n" in _head(closed)


def test_pipelined_requests_are_answered_in_order(server: Any) -> None:
    def three(s: RouterSetup) -> bytes:
        return (_request(s, ROUTE, headers={"X-Request-ID": "p-1"})
                + _request(s, {**ROUTE, "ttft_ms": -1}, headers={"X-Request-ID": "p-2"})
                + b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Request-ID: p-3\r\n\r\n"
                + _request(s, ROUTE, who="b", headers={"X-Request-ID": "p-4"}))

    got = _one(server, three, answers=4)
    assert [re.search(rb"x-request-id: (\S+)", a).group(1) for a in got] == [b"p-1", b"p-2", b"p-3", b"p-4"]  # type: ignore[union-attr]
    assert [_status(a) for a in got] == [200, 422, 200, 200]


def test_full_pools_answer_429(server: Any) -> None:
    statuses = []
    for _ in range(16):  # 2 replicas x 7 slots of the one allowed pool, then full
        got = _one(server, lambda s: _request(s, {**ROUTE, "input_tokens": 4000, "max_output_tokens": 2000,
                                                  "ttft_ms": 60000, "tpot_ms": 1000, "constraints": ONE_POOL}))[0]
        statuses.append(_status(got))
    assert statuses == [200] * 14 + [429] * 2
    assert b"retry-after: 3600\r\n" in got and b'"queue_full":1' in got


def test_access_lines_and_error_counters(server: Any, logs: LogCapture) -> None:
    srv, setup = server
    before = _errors_422(srv, setup)
    rid = f"acc-{time.time_ns()}"
    _one(server, lambda s: _request(s, ROUTE, headers={"X-Request-ID": rid, "traceparent": TRACE}))
    _one(server, lambda s: _request(s, {**ROUTE, "origin": "nowhere"}, headers={"X-Request-ID": rid + "e"}))
    _one(server, lambda s: _request(s, {**ROUTE, "ttft_ms": 0}, headers={"X-Request-ID": rid + "v"}))
    lines = {r["request_id"]: r for r in logs.records() if r.get("request_id", "").startswith(rid)}
    ok = lines[rid]
    assert ok.pop("ts") and ok.pop("ms") >= 0 and ok.pop("decision_id").startswith("d_")
    assert ok == {"level": "info", "logger": "xroute.router.access", "msg": "request", "request_id": rid,
                  "method": "POST", "route": "/v1/route", "status": 200, "tenant": "a", "trace_id": TRACE[3:35]}
    assert lines[rid + "e"]["status"] == 422 and lines[rid + "e"]["decision_id"].startswith("d_")
    assert lines[rid + "v"]["status"] == 422 and "decision_id" not in lines[rid + "v"]  # refused before deciding
    assert lines[rid + "v"]["route"] == "/v1/route" and lines[rid + "v"]["tenant"] == "a"
    assert _errors_422(srv, setup) == before + 2


def _errors_422(srv: ServerThread, setup: RouterSetup) -> float:
    import httpx

    text = httpx.get(f"{srv.url}/metrics", headers=setup.auth("admin")).text
    found = re.findall(r'xroute_router_errors_total\{route="/v1/route",status="422"\} (\S+)', text)
    return float(found[0]) if found else 0.0


def test_a_dead_decision_log_answers_503(server: Any) -> None:
    srv, _ = server
    os.kill(_router_app(srv).services.store._proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _router_app(srv).services.store.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    got = _one(server, lambda s: _request(s, ROUTE, headers={"X-Request-ID": "dead-1"}))[0]
    assert got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 5\r\n" in got and b"x-request-id: dead-1\r\n" in got
    assert _json(got)["error"] == "unavailable"


def _router_app(srv: ServerThread) -> Any:
    app = srv.config.loaded_app
    while not hasattr(app, "services"):
        app = app.app
    return app


def test_a_slow_body_and_a_graceful_shutdown_mid_commit(tmp_path: Path) -> None:
    """A body that arrives in pieces is answered; a shutdown that begins while an answer waits for
    its commit (the writer process paused) lets that answer go out, with ``connection: close``,
    before the server stops — and the decision is in the log."""
    import sqlite3

    setup = _setup(tmp_path)
    srv = ServerThread(create_app(setup.settings))
    srv.__enter__()
    try:
        raw = _request(setup, ROUTE, headers={"X-Request-ID": "slow-1"})
        head, _, body = raw.partition(b"\r\n\r\n")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(head + b"\r\n\r\n")
            time.sleep(0.2)
            s.sendall(body[:7])
            time.sleep(0.2)
            s.sendall(body[7:])
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-request-id: slow-1\r\n" in answer

        writer = _router_app(srv).services.store._proc.pid
        os.kill(writer, signal.SIGSTOP)
        try:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(_request(setup, ROUTE, headers={"X-Request-ID": "mid-commit"}))
            time.sleep(0.3)  # decided; its commit waits for the paused writer
            srv.server.should_exit = True
            time.sleep(0.5)  # uvicorn is shutting down: no new connections, ours waits
            assert srv.thread.is_alive()
        finally:
            os.kill(writer, signal.SIGCONT)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        s.close()
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nconnection: close\r\n" in got.partition(b"\r\n\r\n")[0] + b"\r\n"
        decision_id = json.loads(got.partition(b"\r\n\r\n")[2])["decision_id"]
        srv.thread.join(timeout=30)
        assert not srv.thread.is_alive()
        with sqlite3.connect(setup.settings.db_path) as conn:
            assert conn.execute("SELECT COUNT(*) FROM decisions WHERE decision_id = ?", (decision_id,)).fetchone()[0] == 1
    finally:
        srv.__exit__(None, None, None)


def test_an_added_asgi_middleware_sees_the_route(tmp_path: Path) -> None:
    """``POST /v1/route`` goes through FastAPI's middleware stack like every route: a pure ASGI
    middleware added with ``add_middleware`` sees the request and its answer."""
    seen: list[tuple[str, str, int]] = []

    class Spy:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def spy_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    seen.append((scope["method"], scope["path"], message["status"]))
                await send(message)

            await self.app(scope, receive, spy_send if scope["type"] == "http" else send)

    setup = _setup(tmp_path)
    app = create_app(setup.settings)
    app.add_middleware(Spy)
    with ServerThread(app) as url:
        import httpx

        ok = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=10)
        bad = httpx.post(f"{url}/v1/route", json={**ROUTE, "ttft_ms": 0}, headers=setup.auth("a"), timeout=10)
    assert ok.status_code == 200 and bad.status_code == 422
    assert [x for x in seen if x[1] == "/v1/route"] == [("POST", "/v1/route", 200), ("POST", "/v1/route", 422)]
