"""Migration webhooks (``router/service/webhooks.py``, ``docs/migration.md`` "Webhooks"): a real router
(uvicorn on loopback, the SQLite log) notifies a real HTTP receiver on loopback when a migration
ends -- signed, retried with backoff, delivered after a restart, given up after its attempts."""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from router.core.settings import load_settings
from tests.servers import free_port
from tests.test_migration import PREFER_SPOT, SPOT, Live, _deadline, _env, serving
from tests.test_router_support import make_setup
from xroute.errors import ConfigError
from xroute.schema.migration import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    MigrationNotice,
    sign_webhook,
    verify_webhook,
)

SECRET_ENV = "XROUTE_TEST_WEBHOOK_SECRET"


class Receiver:
    """An HTTP server on loopback that records every webhook call. A session whose id starts with
    ``flaky`` is answered 503 twice, then 200; ``dead``: always 500; others 200."""

    def __init__(self, port: int | None = None):
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                sid = json.loads(body)["session"]["session_id"]
                with rec.lock:
                    rec.calls.append({"at": time.time(), "body": body, "headers": dict(self.headers), "session": sid})
                    seen = sum(c["session"] == sid for c in rec.calls)
                code = 500 if sid.startswith("dead") else (503 if sid.startswith("flaky") and seen <= 2 else 200)
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/xroute"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of(self, sid: str) -> list[dict[str, Any]]:
        with self.lock:
            return [c for c in self.calls if c["session"] == sid]

    def wait(self, sid: str, n: int, within: float = 20.0) -> list[dict[str, Any]]:
        end = time.monotonic() + within
        while len(self.of(sid)) < n:
            assert time.monotonic() < end, f"{sid}: {len(self.of(sid))} calls, wanted {n}"
            time.sleep(0.05)
        return self.of(sid)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    value = secrets.token_hex(16)  # made up per run: no credential lives in the tests
    monkeypatch.setenv(SECRET_ENV, value)
    return value.encode()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _setup(root: Path, url: str, **kw: Any) -> Any:
    opts = {"migration_poll_s": 0.05, "migration_timeout_s": 1.5, "webhook_backoff_s": 0.1,
            "webhook_backoff_max_s": 0.4, "webhook_max_attempts": 3, **kw}
    return make_setup(root, env=_env(root), tenants={"a": {"webhook": {"url": url, "secret": f"env:{SECRET_ENV}"}}}, **opts)


def _pair(pool: str) -> dict[str, Any]:
    """Constraints keeping a session on ``pool`` or its on-demand twin (tests that move two groups
    keep them apart: one event never moves the other's sessions)."""
    return {"allow": [{"offering_ids": [pool, pool.replace(":spot", ":on_demand")]}], **PREFER_SPOT}


def _move(lv: Live, prefix: str, pool: str, event_id: str, verify: bool = True,
          constraints: dict[str, Any] | None = None) -> list[str]:
    """Sessions placed on ``pool`` (tenant a), an interruption on it, and -- ``verify`` -- every
    session's snapshot announced and verified (committed)."""
    placed = lv.sessions(8, prefix, constraints=constraints or PREFER_SPOT)
    on = sorted(s for s, p in placed.items() if p == pool)
    assert on, placed
    r = lv.event({"event_id": event_id, "kind": "interruption", "pool": pool, "deadline": _deadline(120)})
    assert r.status_code == 200 and r.json()["migrations"] == len(on), r.text
    if verify:
        digest = hashlib.sha256(b"kv").hexdigest()
        for s in on:
            m = lv.wait_state(s, {"target_chosen"})["migration"]
            assert lv.c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=lv.E, json={
                "migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 4, "sha256": digest,
                "uri": f"s3://snap/{s}"}).status_code == 200
            assert lv.c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=lv.E, json={
                "migration_id": m["migration_id"], "target": m["target"], "sha256": digest}).json()["state"] == "committed"
    return on


def _deliveries(setup: Any) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(setup.settings.db_path) as conn:
        return {sid: (st, n) for sid, st, n in conn.execute(
            "SELECT session_id, status, attempts FROM webhook_deliveries")}


def test_a_committed_migration_is_notified_once_signed(tmp_path: Path, secret: bytes, receiver: Receiver) -> None:
    setup = _setup(tmp_path, receiver.url)
    with serving(setup) as lv:
        on = _move(lv, "ok", SPOT["aws"], "ev-ok")
        for s in on:
            calls = receiver.wait(s, 1)
            c = calls[0]
            assert verify_webhook(secret, c["body"], c["headers"][SIGNATURE_HEADER], time.time())
            assert not verify_webhook(b"another secret", c["body"], c["headers"][SIGNATURE_HEADER], time.time())
            n = MigrationNotice.model_validate_json(c["body"])
            assert n.type == "session.migration.committed" and n.delivery_id == c["headers"][DELIVERY_HEADER]
            view = lv.session(s)  # the notice says what GET /v1/sessions/{id} says
            assert n.session.placement == view["placement"] != SPOT["aws"]
            assert n.session.version == view["version"] and n.session.replay_from == 5 and not n.session.migrating
        time.sleep(0.5)
        assert all(len(receiver.of(s)) == 1 for s in on)  # a 2xx ends it: never sent twice
        assert {s: v for s, v in _deliveries(setup).items()} == {s: ("delivered", 1) for s in on}
        assert lv.app.services.metrics.webhooks.labels("delivered")._value.get() == len(on)
        assert SECRET_ENV not in json.dumps(receiver.calls[0]["headers"])  # (the secret is never sent)


def test_failures_are_retried_with_backoff_then_given_up(tmp_path: Path, secret: bytes, receiver: Receiver) -> None:
    setup = _setup(tmp_path, receiver.url)
    with serving(setup) as lv:
        flaky = _move(lv, "flaky", SPOT["aws"], "ev-flaky", constraints=_pair(SPOT["aws"]))
        dead = _move(lv, "dead", SPOT["gcp"], "ev-dead", constraints=_pair(SPOT["gcp"]))
        for s in flaky:
            calls = receiver.wait(s, 3)
            assert len({c["headers"][DELIVERY_HEADER] for c in calls}) == 1  # one delivery, three attempts
            assert calls[1]["at"] - calls[0]["at"] >= 0.05 - 0.01  # backoff 0.1 s x jitter [0.5, 1]
        for s in dead:
            receiver.wait(s, 3)
        end = time.monotonic() + 10
        while not all(_deliveries(setup).get(s, ("", 0))[0] == "failed" for s in dead):
            assert time.monotonic() < end, _deliveries(setup)
            time.sleep(0.05)
        got = _deliveries(setup)
        assert all(got[s] == ("delivered", 3) for s in flaky), got
        assert all(got[s] == ("failed", 3) for s in dead), got
        time.sleep(0.6)  # (past the longest backoff: nothing more is sent for a failed delivery)
        assert all(len(receiver.of(s)) == 3 for s in dead)


def test_rolled_back_and_aborted_migrations_are_notified(tmp_path: Path, secret: bytes, receiver: Receiver) -> None:
    setup = _setup(tmp_path, receiver.url)
    with serving(setup) as lv:
        # a rebalance nobody snapshots within migration_timeout_s: rolled back, the session stays
        pool = SPOT["gcp"]
        placed = lv.sessions(6, "rb", constraints=_pair(pool))
        on = sorted(s for s, p in placed.items() if p == pool)
        assert on and lv.event({"event_id": "ev-rb", "kind": "rebalance", "pool": pool}).status_code == 200
        for s in on:
            n = MigrationNotice.model_validate_json(receiver.wait(s, 1)[0]["body"])
            assert n.type == "session.migration.rolled_back" and n.session.placement == pool
        # a session only the interrupted pool may take: aborted, no placement (route it anew)
        only = {"allow": [{"offering_ids": [SPOT["aws"]]}]}
        lone = lv.sessions(1, "lone", constraints=only)
        assert lone == {"lone0": SPOT["aws"]}
        assert lv.event({"event_id": "ev-ab", "kind": "interruption", "pool": SPOT["aws"],
                         "deadline": _deadline(60)}).json()["migrations"] >= 1
        n = MigrationNotice.model_validate_json(receiver.wait("lone0", 1)[0]["body"])
        assert n.type == "session.migration.aborted" and n.session.placement is None


def test_a_notice_waits_out_a_dead_receiver_and_a_router_restart(tmp_path: Path, secret: bytes) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/hooks/xroute"  # nothing listens there yet
    setup = _setup(tmp_path, url, webhook_max_attempts=1000)
    with serving(setup) as lv:
        on = _move(lv, "late", SPOT["aws"], "ev-late")
        end = time.monotonic() + 10
        while not all(_deliveries(setup).get(s, ("", 0))[1] >= 2 for s in on):  # refused, retried
            assert time.monotonic() < end, _deliveries(setup)
            time.sleep(0.05)
    assert all(v[0] == "pending" for v in _deliveries(setup).values())
    rcv = Receiver(port)  # the receiver comes up; a new router on the same log sends what is pending
    with serving(setup):
        for s in on:
            calls = rcv.wait(s, 1)
            assert MigrationNotice.model_validate_json(calls[0]["body"]).session.session_id == s
        end = time.monotonic() + 10
        while not all(v[0] == "delivered" for v in _deliveries(setup).values()):
            assert time.monotonic() < end, _deliveries(setup)
            time.sleep(0.05)
        rcv.close()


def test_the_signature_is_checked_on_time_secret_and_bytes() -> None:
    key, body = b"k" * 32, b'{"type":"session.migration.committed"}'
    header = sign_webhook(key, body, 1_800_000_000)
    assert verify_webhook(key, body, header, 1_800_000_100)
    assert not verify_webhook(key, body + b" ", header, 1_800_000_100)  # other bytes
    assert not verify_webhook(key, body, header, 1_800_000_000 + 301)  # replayed too late
    assert not verify_webhook(b"x" * 32, body, header, 1_800_000_100)  # another secret
    assert not verify_webhook(key, body, "v1=abc", 1_800_000_100) and not verify_webhook(key, body, "", 0)


@pytest.mark.parametrize("hook, field", [
    ({"url": "ftp://example.invalid/x", "secret": f"env:{SECRET_ENV}"}, "url"),
    ({"url": "https://example.invalid/x"}, "secret"),
    ({"url": "https://example.invalid/x", "secret": "hunter2"}, "secret"),  # a secret itself: refused
    ({"url": "https://example.invalid/x", "secret": "env:not a name"}, "secret"),
    ({"url": "https://example.invalid/x", "secret": "file:relative/path"}, "secret"),
])
def test_a_bad_webhook_setting_is_refused_naming_its_field(tmp_path: Path, hook: dict[str, Any], field: str) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(json.dumps({"tenants": {"a": {"webhook": hook}}}))
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert "tenants.a.webhook" in str(e.value) and field in str(e.value)
    assert "hunter2" not in str(e.value)
