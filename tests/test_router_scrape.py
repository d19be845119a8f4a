"""The pools' inference servers' own load (``router/service/scrape.py``): vLLM's Prometheus exposition parsed,
servers scraped over real HTTP (a local server standing in for vLLM's ``/metrics``), combined per
pool, and read by the decision: a pool whose servers report a long queue loses the request it would
otherwise get, and a server that stops answering is forgotten after ``inference_stale_s``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.app.factory import create_app
from router.decision.engine import RoutingEngine
from router.service.scrape import ServerLoad, parse_metrics
from tests.servers import ServerThread
from tests.state_support import decide
from tests.test_router_support import ROUTE, make_setup
from xroute.errors import ConfigError
from xroute.schema.access import Principal
from xroute.schema.decision import RouteRequest

NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def vllm_metrics(running: float, waiting: float, kv: float, models: tuple[str, ...] = ("llama",)) -> str:
    """A vLLM server's /metrics, as it writes them (one series per model name; other families too)."""
    out = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
           "# TYPE vllm:num_requests_running gauge"]
    out += [f'vllm:num_requests_running{{engine="0",model_name="{m}"}} {running / len(models)}' for m in models]
    out += ["# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge"]
    out += [f'vllm:num_requests_waiting{{engine="0",model_name="{m}"}} {waiting / len(models)}' for m in models]
    out += ["# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge"]
    out += [f'vllm:kv_cache_usage_perc{{engine="0",model_name="{m}"}} {kv}' for m in models]
    out += ["# HELP vllm:prompt_tokens_total Number of prefill tokens processed.", "# TYPE vllm:prompt_tokens_total counter",
            'vllm:prompt_tokens_total{engine="0",model_name="llama"} 123456.0']
    return "\n".join(out) + "\n"


def test_the_exposition_is_summed_over_series_and_missing_counts_are_absent() -> None:
    assert parse_metrics(vllm_metrics(6, 4, 0.5, ("a", "b")), *NAMES) == ServerLoad(6.0, 4.0, 0.5)
    assert parse_metrics(vllm_metrics(2, 0, 0.1), *NAMES) == ServerLoad(2.0, 0.0, 0.1)
    v0 = vllm_metrics(3, 1, 0.9).replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_metrics(v0, *NAMES) == ServerLoad(3.0, 1.0, None)  # another name: not exposed
    assert parse_metrics(v0, NAMES[0], NAMES[1], "vllm:gpu_cache_usage_perc") == ServerLoad(3.0, 1.0, 0.9)
    assert parse_metrics("# TYPE up gauge\nup 1\n", *NAMES) is None
    with pytest.raises(ValueError):
        parse_metrics("vllm:num_requests_running{ 1\n", *NAMES)


class _Metrics(BaseHTTPRequestHandler):
    body = ""
    status = 200

    def do_GET(self) -> None:  # http.server's name
        data = type(self).body.encode()
        self.send_response(type(self).status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def vllm() -> Iterator[tuple[str, type[_Metrics], ThreadingHTTPServer]]:
    handler = type("Handler", (_Metrics,), {"body": vllm_metrics(0, 0, 0.0)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", handler, server
    finally:
        server.shutdown()
        server.server_close()


def test_a_scraped_queue_moves_the_request_and_a_silent_server_is_forgotten(tmp_path: Path, vllm: Any) -> None:
    url, handler, server = vllm
    base = make_setup(tmp_path / "base", replay_speed=1e-6)
    engine = RoutingEngine(base.settings)
    req = RouteRequest.model_validate(ROUTE)
    chosen = decide(engine, req, Principal("a", "tenant", "k"), "d_0", engine.source.start_wall)[2]  # type: ignore[attr-defined]
    servers = [{"offering_id": chosen, "endpoints": [url, url]}]  # two servers (the same stand-in twice)
    setup = make_setup(tmp_path, replay_speed=1e-6, inference_servers=servers, inference_scrape_s=0.05,
                       inference_stale_s=0.6)
    srv = ServerThread(create_app(setup.settings))
    with srv as router_url:
        def route() -> str:
            r = httpx.post(f"{router_url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=10)
            assert r.status_code == 200
            fb = {"decision_id": r.json()["decision_id"], "latency_ms": 100.0}
            assert httpx.post(f"{router_url}/v1/feedback", json=fb, headers=setup.auth("a")).status_code == 201
            return str(r.json()["offering"]["offering_id"])

        def reported() -> dict[str, Any]:
            return httpx.get(f"{router_url}/v1/admin/status", headers=setup.auth("admin")).json()["inference_servers"]

        assert route() == chosen  # idle servers: the same choice as without them
        handler.body = vllm_metrics(running=200, waiting=400, kv=0.5)  # each server: a long queue
        time.sleep(0.3)
        app = srv.config.loaded_app
        while not hasattr(app, "services"):
            app = app.app
        engine2 = app.services.engine
        key = engine2.pool_key_of(chosen)
        assert engine2.env.view_server_busy[engine2.pool_index[key]] == 1200.0  # two servers, summed
        assert route() != chosen and reported() == {"pools": 1, "servers": 2, "failing": {}}
        handler.body = vllm_metrics(running=0, waiting=0, kv=0.99)  # counts idle, KV cache full: no free slot
        time.sleep(0.3)
        m, a = engine2.pool_index[key]
        assert engine2.env.view_server_busy[m, a] == engine2.env.slots[m, a]
        handler.body = vllm_metrics(running=200, waiting=400, kv=0.5)
        time.sleep(0.3)
        server.shutdown()  # the servers stop answering: forgotten after inference_stale_s
        server.server_close()
        deadline = time.monotonic() + 5
        while engine2.env.view_server_busy[m, a] >= 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine2.env.view_server_busy[m, a] == -1.0 and url in reported()["failing"]
        assert route() == chosen


def test_inference_servers_are_checked_against_the_catalog(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, inference_servers=[{"offering_id": "aws:us-east-1:g5.xlarge:on_dmand",
                                                     "endpoints": ["http://127.0.0.1:1/metrics"]}])
    with pytest.raises(ConfigError, match=r"inference_servers\[0\]\.offering_id'.*on_dmand.*did you mean "
                                          r"aws:us-east-1:g5.xlarge:on_demand"):
        RoutingEngine(setup.settings)
    with pytest.raises(ConfigError, match=r"inference_servers.*endpoints.*not an http"):
        make_setup(tmp_path / "b", inference_servers=[{"offering_id": "x", "endpoints": ["ftp://h/metrics"]}])
