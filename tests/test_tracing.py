"""Traces (``router.core.tracing``, docs/observability.md), end to end: a router with tracing on
sends its spans over OTLP/HTTP to a receiver in the test (a real HTTP server decoding the protobuf
bodies with ``opentelemetry-proto``), the official ``openai`` client calls the gateway with a W3C
``traceparent``, and one trace runs from the gateway request through the route's stages, the
shared-state and decision-log calls and the attempt to the upstream call (GenAI attributes), with
the caller's trace id -- which the stand-in upstream receives, and the decision row and the audit
entry store; ``xroute audit export`` writes the audit log as JSON lines. With tracing off (the
default) neither the SDK nor the exporter is imported (FastAPI imports the API
itself); bad tracing settings name the field."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from typer.testing import CliRunner

from router.app.factory import create_app
from router.core.settings import load_settings
from tests.servers import ServerThread
from tests.test_router_support import make_setup
from tests.vllm_standin import StandIn
from xroute.errors import ConfigError
from xroute_app.cli import app as cli_app

X = "aws:us-east-1:g5.xlarge:on_demand"
MODEL = "llama-2-7b"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
SPOT = {"name": "a-no-spot", "effect": "deny", "target": {"tenants": ["a"]}, "constraints": {"pricing_modes": ["spot"]}}


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, decoded (``ExportTraceServiceRequest``)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        body, more = b"", True
        while more:
            m = await receive()
            body += m.get("body", b"")
            more = m.get("more_body", False)
        assert scope["path"] == "/v1/traces" and dict(scope["headers"])[b"content-type"] == b"application/x-protobuf"
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.lock:
            for rs in req.resource_spans:
                service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append({
                            "name": sp.name, "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                            "parent": sp.parent_span_id.hex(), "kind": sp.kind, "service": service,
                            "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano,
                            "attrs": {a.key: _value(a.value) for a in sp.attributes}})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-protobuf")]})
        await send({"type": "http.response.body", "body": b""})

    def trace(self, trace_id: str, until: Any, timeout: float = 15.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got = [s for s in self.spans if s["trace_id"] == trace_id]
            if until(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    tmp = tmp_path_factory.mktemp("tracing")
    receiver, standin = Receiver(), StandIn()
    with ServerThread(receiver) as r_url, ServerThread(standin) as s_url:
        setup = make_setup(tmp, replay_speed=1e-6, upstreams=[{"offering_id": X, "base_urls": [f"{s_url}/v1"]}],
                           gateway={"origin": "aws:us-east-1"},
                           tracing={"enabled": True, "otlp_endpoint": f"{r_url}/v1/traces", "service_name": "xr-test"})
        with ServerThread(create_app(setup.settings)) as url:
            yield receiver, standin, setup, url


def test_one_trace_from_the_gateway_request_through_the_stages_to_the_upstream_call(traced: tuple[Any, ...]) -> None:
    receiver, standin, setup, url = traced
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=setup.keys["a"], max_retries=0)
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there, how are you"}], max_tokens=8,
        extra_headers={"traceparent": f"00-{TRACE}-{PARENT}-01"})
    assert r.http_response.status_code == 200
    decision_id = r.headers["x-xroute-decision-id"]
    spans = receiver.trace(TRACE, lambda got: any(s["kind"] == 3 for s in got) and any(
        s["name"] == "xroute.decision_log.record" for s in got) and any(s["kind"] == 2 for s in got))
    by_name = {s["name"]: s for s in spans}
    assert all(s["service"] == "xr-test" for s in spans)
    server = [s for s in spans if s["kind"] == 2]  # SERVER
    assert len(server) == 1 and server[0]["name"] == "POST /v1/chat/completions"
    assert server[0]["parent"] == PARENT  # (the caller's span: the trace continues)
    assert server[0]["attrs"]["http.response.status_code"] == 200
    route = by_name["xroute.route"]
    assert route["parent"] == server[0]["span_id"] and route["attrs"]["gen_ai.request.model"] == MODEL
    stages = [s for s in spans if s["name"].startswith("xroute.stage.")]
    assert len(stages) >= 3 and all(s["parent"] == route["span_id"] and s["end"] >= s["start"] for s in stages)
    for name in ("xroute.state.admit", "xroute.decision_log.record"):
        assert by_name[name]["parent"] == route["span_id"], name
    assert by_name["xroute.decision_log.record"]["attrs"]["xroute.decision_id"] == decision_id
    attempt = by_name["xroute.gateway.attempt"]
    assert attempt["parent"] == server[0]["span_id"] and attempt["attrs"]["xroute.decision_id"] == decision_id
    upstream = [s for s in spans if s["kind"] == 3]  # CLIENT
    assert len(upstream) == 1 and upstream[0]["name"] == f"chat {MODEL}"
    up = upstream[0]
    assert up["parent"] == attempt["span_id"]
    assert up["attrs"]["gen_ai.request.model"] == MODEL and up["attrs"]["gen_ai.operation.name"] == "chat"
    assert up["attrs"]["gen_ai.usage.input_tokens"] > 0 and up["attrs"]["gen_ai.usage.output_tokens"] == 8
    # the stand-in upstream got this trace's traceparent, naming the upstream call's span as its parent
    assert standin.requests[-1]["traceparent"] == f"00-{TRACE}-{up['span_id']}-01"
    # the decision row carries the trace id
    con = sqlite3.connect(f"file:{setup.root / 'decisions.db'}?mode=ro", uri=True)
    try:
        deadline = time.monotonic() + 5
        row = None
        while row is None and time.monotonic() < deadline:
            row = con.execute("SELECT trace_id FROM decisions WHERE decision_id = ?", (decision_id,)).fetchone()
    finally:
        con.close()
    assert row == (TRACE,)


def test_a_streamed_call_records_its_ttft_on_the_upstream_span(traced: tuple[Any, ...]) -> None:
    receiver, _, setup, url = traced
    trace = "0af7651916cd43dd8448eb211c80319c"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=setup.keys["a"], max_retries=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream it"}], max_tokens=4, stream=True,
        extra_headers={"traceparent": f"00-{trace}-{PARENT}-01"}))
    assert chunks
    spans = receiver.trace(trace, lambda got: any(s["kind"] == 3 for s in got))
    up = [s for s in spans if s["kind"] == 3]
    assert len(up) == 1 and up[0]["attrs"]["gen_ai.server.time_to_first_token"] > 0
    assert up[0]["attrs"]["gen_ai.usage.output_tokens"] == 4


def test_an_audit_entry_carries_the_trace_id_and_the_export_is_json_lines(traced: tuple[Any, ...]) -> None:
    receiver, _, setup, url = traced
    trace = "5b8efff798038103d269b633813fc60c"
    r = httpx.post(f"{url}/v1/admin/policies", json=SPOT,
                   headers={**setup.auth("admin"), "traceparent": f"00-{trace}-{PARENT}-01"})
    assert r.status_code == 201, r.text
    spans = receiver.trace(trace, lambda got: any(s["kind"] == 2 for s in got))
    assert [s["name"] for s in spans if s["kind"] == 2] == ["POST /v1/admin/policies"]
    out = CliRunner().invoke(cli_app, ["audit", "export", "--db", str(setup.root / "decisions.db"),
                                       "--since", "2000-01-01T00:00:00Z"])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines, "the export is empty"
    ids = [e["audit_id"] for e in lines]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    keys = {"audit_id", "at", "principal", "action", "kind", "resource", "version", "before", "after",
            "request_id", "trace_id"}
    assert all(set(e) == keys for e in lines)
    ours = [e for e in lines if e["resource"] == SPOT["name"]]
    assert len(ours) == 1 and ours[0]["trace_id"] == trace and ours[0]["action"] == "create"
    assert ours[0]["after"]["name"] == SPOT["name"] and ours[0]["principal"].startswith("key:")
    # --until before the change leaves it out; a bad time names the option
    out = CliRunner().invoke(cli_app, ["audit", "export", "--db", str(setup.root / "decisions.db"),
                                       "--until", "2000-01-01T00:00:00Z"])
    assert out.exit_code == 0 and out.stdout == ""
    out = CliRunner().invoke(cli_app, ["audit", "export", "--db", str(setup.root / "decisions.db"),
                                       "--since", "yesterday"])
    assert isinstance(out.exception, ConfigError) and str(out.exception).startswith("--since:")


OFF = """
import sys, httpx
from pathlib import Path
from router.app.factory import create_app
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, make_setup
setup = make_setup(Path(sys.argv[1]))
assert not setup.settings.tracing.enabled
with ServerThread(create_app(setup.settings)) as url:
    r = httpx.post(f"{url}/v1/route", json=ROUTE, headers={**setup.auth("a"),
                   "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    assert r.status_code == 200, r.text
    print(r.json()["decision_id"])
# (FastAPI itself imports the opentelemetry API -- fastapi.telemetry -- so the check is on what tracing
# brings: the SDK, the exporter, the protobuf messages, and our module over them)
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                     "opentelemetry.proto", "router.core.otel"))))
"""


def test_with_tracing_off_neither_the_sdk_nor_the_exporter_is_imported_and_the_row_keeps_the_callers_trace(
        tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", OFF, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    decision_id, modules = out.stdout.strip().splitlines()[-2:]
    assert modules == "[]"
    con = sqlite3.connect(tmp_path / "decisions.db")
    try:
        assert con.execute("SELECT trace_id FROM decisions WHERE decision_id = ?", (decision_id,)).fetchone() == (
            TRACE,)
    finally:
        con.close()


@pytest.mark.parametrize("tracing, field", [
    ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
    ({"otlp_endpoint": "grpc://collector:4317"}, "tracing.otlp_endpoint"),
    ({"service_name": ""}, "tracing.service_name"),
    ({"enabled": "sometimes"}, "tracing.enabled"),
    ({"endpoint": "http://x"}, "tracing.endpoint"),
])
def test_bad_tracing_settings_are_a_config_error_naming_the_field(tracing: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(None, tracing=tracing)
    assert f"field '{field}'" in str(e.value)
