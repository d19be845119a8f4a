"""``router.protocol``: ``POST /v1/route`` answered inside uvicorn's HTTP protocol gives the same
bytes on the wire as the ASGI path (``http_fast_path: false``), for answers and errors alike,
keeps pipelined answers in order, and honours ``Connection: close`` and HTTP/1.0.

Two real servers on loopback ports, one per setting, get the same raw HTTP requests over raw
sockets; their answers are compared byte for byte once the parts that differ by nature (decision
ids, timestamps, the Date header, generated request ids, the telemetry's age) are blanked. The
replay runs at 1e-6 telemetry seconds per second, so both servers decide on the same telemetry.
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

from router.app import create_app
from router.protocol import RouteProtocol, http_protocol
from router.testing import ServerThread
from tests.test_router_support import ROUTE, LogCapture, RouterSetup, make_setup

ONE_POOL = {"allow": [{"offering_ids": ["gcp:europe-west4:g2-standard-4:on_demand"]}]}
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _setup(tmp: Path, fast: bool) -> RouterSetup:
    return make_setup(tmp, http_fast_path=fast, log_level="INFO", replay_speed=1e-6, max_body_bytes=4096, db_writer="process",
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
def servers(tmp_path_factory: pytest.TempPathFactory, logs: LogCapture
            ) -> Iterator[dict[str, tuple[ServerThread, RouterSetup]]]:
    out: dict[str, tuple[ServerThread, RouterSetup]] = {}
    try:
        for name, fast in (("protocol", True), ("asgi", False)):
            setup = _setup(tmp_path_factory.mktemp(name), fast)
            srv = ServerThread(create_app(setup.settings))
            logs.attach()  # (again: create_app sets the router's own handler)
            srv.__enter__()
            out[name] = (srv, setup)
        yield out
    finally:
        for srv, _ in out.values():
            srv.__exit__(None, None, None)


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


_BLANK = [(rb"(?im)^date: [^\r\n]*", b"date: -"),
          (rb'd_[0-9a-f]{32}', b"d_-"),
          (rb'"(created_at|telemetry_time)":"[^"]*"', rb'"\1":"-"'),
          (rb'"age_s":[0-9.e-]+', b'"age_s":-'),
          (rb"(?im)^x-request-id: [0-9a-f]{16}\r$", b"x-request-id: generated\r"),
          (rb'"request_id": ?"[0-9a-f]{16}"', b'"request_id":"generated"')]


def _blank(raw: bytes) -> bytes:
    for pattern, repl in _BLANK:
        raw = re.sub(pattern, repl, raw)
    head, _, body = raw.partition(b"\r\n\r\n")
    # (the blanked parts can differ in length: _exchange read each answer by its Content-Length)
    return re.sub(rb"(?im)^content-length: *\d+", b"content-length: -", head) + b"\r\n\r\n" + body


def _both(servers: dict[str, tuple[ServerThread, RouterSetup]], make: Any, answers: int = 1) -> list[bytes]:
    """The same request(s) to both servers: the answers must be equal once blanked."""
    got = {}
    for name, (srv, setup) in servers.items():
        got[name] = [_blank(a) for a in _exchange(srv.port, make(setup), answers)]
    assert got["protocol"] == got["asgi"], "\n\n".join(b.decode(errors="replace") for b in got["protocol"] + got["asgi"])
    return got["protocol"]


def test_the_protocol_class_is_in_use(servers: Any) -> None:
    srv, setup = servers["protocol"]
    assert issubclass(srv.config.http_protocol_class, RouteProtocol)
    assert servers["asgi"][0].config.http_protocol_class is not None
    assert not issubclass(servers["asgi"][0].config.http_protocol_class, RouteProtocol)
    assert http_protocol(object()) != "auto"  # no setting on a foreign object: the default, on


def test_answers_are_the_asgi_paths_byte_for_byte(servers: Any) -> None:
    cases = [
        lambda s: _request(s, ROUTE, headers={"X-Request-ID": "req-1", "traceparent": TRACE.upper()}),
        lambda s: _request(s, {**ROUTE, "session_id": "s-\u00e9", "constraints": {"pricing_mode": "spot"}}),
        lambda s: _request(s, ROUTE, who="b"),  # the tenant's constraints
        lambda s: _request(s, ROUTE, headers={"Authorization": None, "X-API-Key": s.keys["a"]}),
        lambda s: _request(s, ROUTE, headers={"Content-Type": "application/json; charset=utf-8"}),
        lambda s: _request(s, {**ROUTE, "origin": "aws:us-eats-1"}),  # 422 unknown origin, decided in place
        lambda s: _request(s, {**ROUTE, "constraints": {"allow": [{"regions": ["japaneast"]}],
                                                        "deny": [{"regions": ["japaneast"]}]}}),  # 422 no offering
        lambda s: _request(s, {**ROUTE, "constraints": {"allow": [{"instance_types": ["g5.xlarg"]}]}}),
        lambda s: _request(s, {**ROUTE, "ttft_ms": 0}),  # invalid field: handed over, FastAPI's 422
        lambda s: _request(s, b'{"origin": '),  # invalid JSON: handed over
        lambda s: _request(s, ROUTE, headers={"Authorization": "Bearer xr_00000000_nope"}),  # 401
        lambda s: _request(s, {**ROUTE, "session_id": "x" * 5000}),  # 413
        lambda s: _request(s, ROUTE, headers={"Content-Type": "text/plain"}),  # FastAPI's route decides
        lambda s: _request(s, ROUTE, version="1.0"),  # HTTP/1.0: answered, then closed
        lambda s: _request(s, ROUTE, headers={"Connection": "close", "X-Request-ID": "bad id!"}),
    ]
    for make in cases:
        _both(servers, make)
    first = _both(servers, cases[0])[0]
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-request-id: req-1\r\n" in first
    assert f"traceparent: {TRACE}\r\n".encode() in first


def test_pipelined_requests_are_answered_in_order(servers: Any) -> None:
    def three(s: RouterSetup) -> bytes:
        return (_request(s, ROUTE, headers={"X-Request-ID": "p-1"})
                + _request(s, {**ROUTE, "ttft_ms": -1}, headers={"X-Request-ID": "p-2"})
                + b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Request-ID: p-3\r\n\r\n"
                + _request(s, ROUTE, who="b", headers={"X-Request-ID": "p-4"}))

    got = _both(servers, three, answers=4)
    assert [re.search(rb"x-request-id: (\S+)", a).group(1) for a in got] == [b"p-1", b"p-2", b"p-3", b"p-4"]  # type: ignore[union-attr]
    assert [a.split(b" ")[1] for a in got] == [b"200", b"422", b"200", b"200"]


def test_full_pools_answer_429_alike(servers: Any) -> None:
    statuses = []
    for _ in range(16):  # 2 replicas x 7 slots of the one allowed pool, then full
        got = _both(servers, lambda s: _request(s, {**ROUTE, "input_tokens": 4000, "max_output_tokens": 2000,
                                                    "ttft_ms": 60000, "tpot_ms": 1000, "constraints": ONE_POOL}))
        statuses.append(int(got[0].split(b" ")[1]))
    assert statuses == [200] * 14 + [429] * 2
    assert b"retry-after: 3600\r\n" in got[0] and b'"queue_full":1' in got[0]


def test_access_lines_and_error_counters_match(servers: Any, logs: LogCapture) -> None:
    before = {name: _errors_422(srv, setup) for name, (srv, setup) in servers.items()}
    rid = f"acc-{time.time_ns()}"
    _both(servers, lambda s: _request(s, ROUTE, headers={"X-Request-ID": rid, "traceparent": TRACE}))
    _both(servers, lambda s: _request(s, {**ROUTE, "origin": "nowhere"}, headers={"X-Request-ID": rid + "e"}))
    lines = [r for r in logs.records() if r.get("request_id", "").startswith(rid)]
    for r in lines:
        assert r.pop("ts") and r.pop("ms") >= 0 and r.pop("decision_id").startswith("d_")
    assert len(lines) == 4 and lines[0] == lines[1] and lines[2] == lines[3]  # each request: both servers alike
    assert lines[0] == {"level": "info", "logger": "xroute.router.access", "msg": "request", "request_id": rid,
                        "method": "POST", "route": "/v1/route", "status": 200, "tenant": "a",
                        "trace_id": TRACE[3:35]}
    assert lines[2]["status"] == 422
    for name, (srv, setup) in servers.items():
        assert _errors_422(srv, setup) == before[name] + 1


def _errors_422(srv: ServerThread, setup: RouterSetup) -> float:
    import httpx

    text = httpx.get(f"{srv.url}/metrics", headers=setup.auth("admin")).text
    found = re.findall(r'xroute_router_errors_total\{route="/v1/route",status="422"\} (\S+)', text)
    return float(found[0]) if found else 0.0


def test_a_dead_decision_log_answers_503_alike(servers: Any) -> None:
    for srv, _ in servers.values():
        os.kill(_router_app(srv).services.store._proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    for srv, _ in servers.values():
        while not _router_app(srv).services.store.closed and time.monotonic() < deadline:
            time.sleep(0.05)
    got = _both(servers, lambda s: _request(s, ROUTE, headers={"X-Request-ID": "dead-1"}))
    assert got[0].startswith(b"HTTP/1.1 503 ") and b"retry-after: 5\r\n" in got[0]
    assert b'"error":"unavailable"' in got[0]


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

    setup = _setup(tmp_path, True)
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
