"""``xroute events watch`` (``cloud_adapters/watch.py``): an instance's metadata service -- a stand-in
on loopback answering the clouds' recorded shapes (``tests/fixtures/cloud/metadata/``) -- read, and
its preemption notice posted to a real router as a pool event, once per notice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cloud_adapters.watch import WatchError, event_body, read_notice, watch
from tests.test_migration import PREFER_SPOT, SPOT, Live, _env, serving
from tests.test_router_support import make_setup

FIX = Path(__file__).parent / "fixtures" / "cloud"


class Metadata:
    """A metadata service stand-in: ``notice`` None (nothing scheduled), ``"interruption"`` or
    ``"rebalance"``; answers as ``cloud``'s service does (AWS wants its IMDSv2 token)."""

    def __init__(self, cloud: str):
        self.cloud, self.notice = cloud, None
        #: when the notice's instance stops: fixed, as the clouds' own documents are
        self.ahead = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=90)
        self.requests: list[str] = []
        md = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: str | dict[str, Any], ctype: str = "application/json") -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                md.requests.append(f"PUT {self.path}")
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, "tok-0123", "text/plain")
                else:
                    self._send(400, "bad token request", "text/plain")

            def do_GET(self) -> None:
                md.requests.append(f"GET {self.path}")
                self._send(*md.answer(self.path, dict(self.headers)))

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, headers: dict[str, str]) -> tuple[int, Any, str]:
        ahead = self.ahead
        if self.cloud == "aws":
            if headers.get("X-aws-ec2-metadata-token") != "tok-0123":
                return 401, "no token", "text/plain"
            if path == "/latest/meta-data/instance-id":
                return 200, "i-0abc123def4567890", "text/plain"
            if path == "/latest/meta-data/spot/instance-action" and self.notice == "interruption":
                body = json.loads((FIX / "metadata" / "aws_spot_instance_action.json").read_text())
                body["time"] = ahead.strftime("%Y-%m-%dT%H:%M:%SZ")
                return 200, body, "application/json"
            if path == "/latest/meta-data/events/recommendations/rebalance" and self.notice == "rebalance":
                return 200, json.loads((FIX / "metadata" / "aws_rebalance_recommendation.json").read_text()), \
                    "application/json"
            return 404, "Not Found", "text/plain"
        if self.cloud == "azure":
            if headers.get("Metadata") != "true" or not path.startswith("/metadata/scheduledevents?api-version="):
                return 400, {"error": "Bad request"}, "application/json"
            if self.notice is None:
                return 200, json.loads((FIX / "metadata" / "azure_scheduled_events_empty.json").read_text()), \
                    "application/json"
            doc = json.loads((FIX / "events" / "azure_scheduled_preempt.json").read_text())
            doc["Events"][0]["NotBefore"] = format_datetime(ahead, usegmt=True)
            return 200, doc, "application/json"
        if headers.get("Metadata-Flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header.", "text/plain"
        if path == "/computeMetadata/v1/instance/preempted":
            return 200, "TRUE" if self.notice else "FALSE", "application/text"
        if path == "/computeMetadata/v1/instance/name":
            return 200, "spot-vm-1", "application/text"
        return 404, "Not Found", "text/plain"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("watch")
    with serving(make_setup(root, migration_poll_s=0.05, env=_env(root))) as lv:
        yield lv


@pytest.mark.parametrize("cloud", ["aws", "azure", "gcp"])
def test_a_notice_on_the_metadata_service_becomes_one_pool_event(live: Live, cloud: str) -> None:
    pool = SPOT[cloud]
    placed = live.sessions(6, f"w{cloud}", constraints={"allow": [{"offering_ids": [
        pool, pool.replace(":spot", ":on_demand")]}], **PREFER_SPOT})
    on = [s for s, p in placed.items() if p == pool]
    assert on, placed
    md = Metadata(cloud)
    key = live.E["Authorization"].split()[1]
    lines: list[str] = []
    try:
        assert read_notice(cloud, md.url) is None
        assert watch(cloud, pool, live.url, key, once=True, metadata_url=md.url, log=lines.append) == 0
        events_before = live.counts()[0]
        md.notice = "interruption"
        n = read_notice(cloud, md.url)
        assert n is not None and n.kind == "interruption" and n.deadline is not None
        assert n.deadline > datetime.now(UTC) + timedelta(seconds=(20 if cloud == "gcp" else 60))
        polls = iter(range(3))  # one watcher, three polls of the same notice: posted once
        assert watch(cloud, pool, live.url, key, every_s=0.05, metadata_url=md.url, log=lines.append,
                     stop=lambda: next(polls, None) is None) == 1
        assert len(lines) == 1 and "posted" in lines[-1] and f"{len(on)} migrations" in lines[-1], lines
        for s in on:  # the router took it: the sessions on the pool are migrating
            assert live.session(s)["migration"]["source"] == pool
        assert live.counts()[0] == events_before + 1
        if cloud != "gcp":  # a notice that dates itself: another watcher process posts the same event id
            assert watch(cloud, pool, live.url, key, once=True, metadata_url=md.url, log=lines.append) == 1
            assert "duplicate" in lines[-1]
            assert live.counts()[0] == events_before + 1
        if cloud == "aws":
            assert md.requests[0] == "PUT /latest/api/token"  # IMDSv2: a token before any read
    finally:
        md.close()


def test_an_aws_rebalance_recommendation_has_no_deadline() -> None:
    md = Metadata("aws")
    md.notice = "rebalance"
    try:
        n = read_notice("aws", md.url)
        assert n is not None and n.kind == "rebalance" and n.deadline is None
        body = event_body(n, SPOT["aws"], datetime.now(UTC))
        assert body["kind"] == "rebalance" and "deadline" not in body
        assert body["event_id"] == event_body(n, SPOT["aws"], datetime.now(UTC))["event_id"]  # stable
    finally:
        md.close()


def test_a_metadata_service_that_is_not_there_is_one_readable_error() -> None:
    with pytest.raises(WatchError, match="cannot be reached"):
        read_notice("gcp", "http://127.0.0.1:9")
    with pytest.raises(WatchError, match="--cloud"):
        read_notice("oracle", "http://127.0.0.1:9")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", "events", "watch", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_the_cli_refuses_bad_input_with_one_line(live: Live) -> None:
    md = Metadata("gcp")
    md.notice = "interruption"
    key = live.E["Authorization"].split()[1]
    try:
        r = _cli("--cloud", "gcp", "--pool", SPOT["gcp"], "--router", live.url, "--once", "--metadata-url", md.url,
                 env={"XROUTE_EVENTS_KEY": ""})
        assert r.returncode == 2 and "--key-env" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = _cli("--cloud", "gcp", "--pool", "gcp:nowhere:x:spot", "--router", live.url, "--once", "--metadata-url",
                 md.url, env={"XROUTE_EVENTS_KEY": key})
        assert r.returncode == 2 and "unknown pool" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        md.close()
