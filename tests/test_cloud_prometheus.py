"""Pool utilization from a Prometheus HTTP API (recorded DCGM exporter answers on a loopback server)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from cloud_adapters.base import PoolSelector
from cloud_adapters.errors import CloudResponseError, CloudUnavailableError
from cloud_adapters.prometheus import PrometheusSource
from tests.clouds import FakeCloudServer, Fault, Response, Route, prometheus_server
from xroute.errors import ConfigError

FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 2.0}
T0 = datetime.fromtimestamp(1714600800, UTC)


@pytest.fixture(scope="module")
def server():
    with prometheus_server() as s:
        yield s


def pool(url: str, **kw) -> PoolSelector:
    return PoolSelector(offering_id="aws:us-east-1:g5.xlarge:on_demand", source="prometheus", url=url,
                        selector='pool="g5-east"', **kw)


def test_gpu_and_cpu_utilization_per_timestamp(server):
    server.reset()
    p = pool(server.url, cpu_query='1 - avg(rate(node_cpu_seconds_total{mode="idle",{selector}}[5m]))')
    got = PrometheusSource(FAST).utilization(p, T0, T0 + timedelta(minutes=10))
    assert len(got) == 10 and got[0].ts == T0
    assert got[0].gpu_util == pytest.approx(0.35) and got[1].gpu_util == pytest.approx(0.40)
    assert got[0].cpu_util == pytest.approx(0.25)  # the mean of the two series answered
    q = [path for _, _, path in server.log]
    assert "DCGM_FI_DEV_GPU_UTIL%7Bpool%3D%22g5-east%22%7D" in q[0] and "step=60s" in q[0]


def test_without_cpu_query_cpu_is_unknown(server):
    got = PrometheusSource(FAST).utilization(pool(server.url), T0, T0 + timedelta(minutes=10))
    assert all(s.cpu_util is None for s in got)


def test_5xx_is_retried_and_a_stall_times_out(server):
    server.reset()
    server.inject("query_range", Fault.error(503), Fault.stall(1.0))
    src = PrometheusSource({**FAST, "timeout_s": 0.3})
    assert src.utilization(pool(server.url), T0, T0 + timedelta(minutes=10))
    assert src.stats.retries["query_range"] == 2


def test_a_query_error_is_reported_with_its_field():
    def bad(req, s):
        return Response(200, json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error"}).encode())

    with FakeCloudServer("prometheus", [Route("query_range", lambda r: True, bad)]) as srv:
        with pytest.raises(CloudResponseError, match=r"prometheus aws:us-east-1:g5.xlarge:on_demand query_range: "
                                                      r"query failed: bad_data parse error \(field 'status'\)"):
            PrometheusSource(FAST).utilization(pool(srv.url), T0, T0 + timedelta(minutes=1))


def test_malformed_body(server):
    server.inject("query_range", Fault.malformed())
    with pytest.raises(CloudResponseError, match="not JSON"):
        PrometheusSource(FAST).utilization(pool(server.url), T0, T0 + timedelta(minutes=1))


def test_unreachable_server():
    with pytest.raises(CloudUnavailableError):
        PrometheusSource({**FAST, "max_attempts": 1}).utilization(pool("http://127.0.0.1:9"), T0, T0)


def test_a_url_is_required(monkeypatch):
    monkeypatch.delenv("XROUTE_PROMETHEUS_URL", raising=False)
    with pytest.raises(ConfigError, match="no URL"):
        PrometheusSource(FAST).utilization(PoolSelector(offering_id="x", source="prometheus"), T0, T0)
