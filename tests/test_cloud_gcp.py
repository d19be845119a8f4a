"""The GCP adapter: real google-cloud-compute clients (REST transport, anonymous credentials) and
httpx against a local server serving recorded Compute Engine and Cloud Billing Catalog payloads."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from cloud_adapters.errors import CloudAuthError, CloudResponseError, CloudThrottledError, CloudUnavailableError
from cloud_adapters.gcp import GcpAdapter
from tests.clouds import FIXTURES, Fault, gcp_server
from xroute.errors import ConfigError

FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 2.0}
ENV = {"XROUTE_GCP_CREDENTIALS": "anonymous", "GOOGLE_CLOUD_PROJECT": "xroute-test"}
# the recorded Catalog's Americas unit prices
A2_CORE, A2_RAM, A100 = 0.031611, 0.004237, 2.933908


@pytest.fixture(scope="module")
def server():
    with gcp_server() as s:
        yield s


@pytest.fixture
def gcp(server, monkeypatch):
    server.reset()
    monkeypatch.setenv("XROUTE_GCP_ENDPOINT", server.url)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    return server


def adapter(**cfg) -> GcpAdapter:
    return GcpAdapter({**FAST, **cfg})


def test_offerings_from_machine_and_accelerator_types_per_zone(gcp):
    offers = {o.instance_type: o for o in adapter().offerings("us-central1")}
    assert set(offers) == {"a2-highgpu-1g", "a2-highgpu-2g", "a2-ultragpu-1g", "a3-highgpu-8g", "g2-standard-4",
                           "g2-standard-8"}
    a2 = offers["a2-highgpu-1g"]
    assert (a2.accelerator, a2.accelerator_count, a2.vcpus, a2.memory_gib) == ("A100", 1, 12.0, 85.0)
    assert offers["a3-highgpu-8g"].accelerator == "H100" and offers["a2-ultragpu-1g"].accelerator == "A100-80GB"
    # zone b's recording lists fewer machine types
    assert offers["a2-highgpu-2g"].zones == ("us-central1-a", "us-central1-c")
    assert offers["g2-standard-4"].zones == ("us-central1-a", "us-central1-b", "us-central1-c")
    assert gcp.hits["regions.get"] == 1 and gcp.hits["acceleratorTypes.list"] == 3
    assert gcp.hits["machineTypes.list"] == 5  # zones a and c have two pages (pageToken), b one
    assert any("pageToken=" in path for _, _, path in gcp.log)


def test_prices_are_built_from_catalog_unit_prices(gcp):
    a = adapter()
    od = {p.instance_type: p for p in a.on_demand_prices("us-central1", ["a2-highgpu-1g", "g2-standard-4"])}
    assert od["a2-highgpu-1g"].usd_per_hour == pytest.approx(12 * A2_CORE + 85 * A2_RAM + A100, abs=1e-5)
    spot = {p.instance_type: p for p in a.spot_prices("us-central1", ["a2-highgpu-1g"])}
    assert spot["a2-highgpu-1g"].usd_per_hour < od["a2-highgpu-1g"].usd_per_hour / 2
    assert spot["a2-highgpu-1g"].pricing_mode == "spot"
    assert gcp.hits["skus.list"] == 2  # the catalog (two pages) is read once for both modes
    assert od["a2-highgpu-1g"].ts.year == 2024


def test_regions_outside_the_sku_geography_get_that_geography_price(gcp):
    eu = {p.instance_type: p for p in adapter().on_demand_prices("europe-west4", ["a2-highgpu-1g"])}
    assert eu["a2-highgpu-1g"].usd_per_hour == pytest.approx((12 * A2_CORE + 85 * A2_RAM + A100) * 1.1, abs=1e-5)


def test_a_region_the_catalog_does_not_price_leaves_types_unpriced(gcp):
    assert adapter().on_demand_prices("asia-south2", ["a2-highgpu-1g"]) == []


def test_region_quotas_gpus_and_vcpus(gcp):
    q = {r.quota_name: r for r in adapter().quotas("us-central1")}
    assert q["NVIDIA_A100_GPUS"].unit == "gpus" and (q["NVIDIA_A100_GPUS"].limit, q["NVIDIA_A100_GPUS"].usage) == (16, 1)
    assert q["PREEMPTIBLE_NVIDIA_L4_GPUS"].unit == "gpus"
    assert q["CPUS"].unit == "vcpus" and q["A2_CPUS"].limit == 96
    assert "DISKS_TOTAL_GB" not in q and "INSTANCES" not in q
    # what each counts: on-demand or spot vCPUs, a family's, the machine types with that GPU
    assert q["CPUS"].covers == ("gcp:us-central1:*:on_demand",) and q["A2_CPUS"].covers == ("gcp:us-central1:a2-*:on_demand",)
    a100 = q["NVIDIA_A100_GPUS"].covers
    assert a100 and all(c.startswith("gcp:us-central1:a2-") and c.endswith(":on_demand") for c in a100)
    l4 = q["PREEMPTIBLE_NVIDIA_L4_GPUS"].covers
    assert l4 and all(c.startswith("gcp:us-central1:g2-") and c.endswith(":spot") for c in l4)


@pytest.mark.parametrize("route,fault", [("regions.get", Fault.throttle(retry_after=0.2)),
                                         ("machineTypes.list", Fault.error(503)),
                                         ("acceleratorTypes.list", Fault.error(500)),
                                         ("machineTypes.list", Fault.truncate())],
                         ids=["429", "503", "500", "truncated"])
def test_transient_compute_failures_are_retried(gcp, route, fault):
    gcp.inject(route, fault)
    a = adapter()
    assert len(a.offerings("us-central1")) == 6
    assert sum(a.stats.retries.values()) == 1


def test_catalog_throttling_honours_retry_after(gcp):
    gcp.inject("skus.list", Fault.throttle(retry_after=0.4))
    a = adapter()
    a.offerings("us-central1")
    t0 = time.monotonic()
    assert a.on_demand_prices("us-central1", ["g2-standard-4"])
    assert time.monotonic() - t0 >= 0.4


def test_stalled_catalog_times_out_and_is_retried(gcp):
    gcp.inject("skus.list", Fault.stall(1.2))
    a = adapter(timeout_s=0.4)
    assert a.on_demand_prices("us-central1", ["g2-standard-4"])
    assert a.stats.retries["services.skus.list"] == 1


def test_persistent_throttling_ends_in_a_clear_error(gcp):
    gcp.inject("regions.get", *[Fault.throttle(retry_after=0)] * 2)
    with pytest.raises(CloudThrottledError, match=r"gcp europe-west4 regions.get"):
        adapter(max_attempts=2).quotas("europe-west4")


def test_persistent_5xx_ends_in_unavailable(gcp):
    gcp.inject("skus.list", *[Fault.error(503)] * 2)
    with pytest.raises(CloudUnavailableError, match=r"gcp us-central1 services.skus.list|gcp services.skus.list"):
        adapter(max_attempts=2).spot_prices("us-central1", ["g2-standard-4"])


def test_forbidden_is_an_auth_error(gcp):
    gcp.inject("regions.get", Fault.error(403))
    with pytest.raises(CloudAuthError, match=r"roles/compute.viewer"):
        adapter().quotas("us-central1")


def test_malformed_bodies_are_clear_errors(gcp):
    gcp.inject("regions.get", Fault.malformed())
    with pytest.raises(CloudResponseError, match=r"gcp us-central1 regions.get"):
        adapter().quotas("us-central1")
    gcp.inject("skus.list", Fault.malformed())
    with pytest.raises(CloudResponseError, match="not JSON"):
        adapter().on_demand_prices("us-central1", ["g2-standard-4"])


def test_missing_fields_are_named(gcp, tmp_path, monkeypatch):
    fx = tmp_path / "fx"
    shutil.copytree(FIXTURES, fx)
    p = fx / "gcp" / "machine_types_a.page1.json"
    doc = json.loads(p.read_text())
    del doc["items"][1]["guestCpus"]
    p.write_text(json.dumps(doc))
    r = fx / "gcp" / "region.json"
    doc = json.loads(r.read_text())
    del doc["quotas"][2]["limit"]
    r.write_text(json.dumps(doc))
    with gcp_server(fx) as srv:
        monkeypatch.setenv("XROUTE_GCP_ENDPOINT", srv.url)
        with pytest.raises(CloudResponseError) as e:
            adapter().offerings("us-central1")
        assert e.value.field == "items[1].guestCpus" and e.value.region == "us-central1"
        with pytest.raises(CloudResponseError) as e:
            adapter().quotas("us-central1")
        assert e.value.field == "quotas[2].limit"


def test_anonymous_credentials_only_for_a_local_endpoint(monkeypatch):
    monkeypatch.delenv("XROUTE_GCP_ENDPOINT", raising=False)
    monkeypatch.setenv("XROUTE_GCP_CREDENTIALS", "anonymous")
    with pytest.raises(ConfigError, match="only for a local endpoint"):
        adapter().quotas("us-central1")


def test_a_project_is_required(gcp, monkeypatch):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT")
    monkeypatch.delenv("CLOUDSDK_CORE_PROJECT", raising=False)
    with pytest.raises(ConfigError, match="GOOGLE_CLOUD_PROJECT"):
        adapter().quotas("us-central1")


def test_api_endpoint_is_regional(monkeypatch):
    monkeypatch.delenv("XROUTE_GCP_ENDPOINT", raising=False)
    assert adapter().api_endpoint("us-central1") == ("us-central1-compute.googleapis.com", 443)


def _pool(**kw):
    from cloud_adapters.base import PoolSelector

    return PoolSelector(offering_id="gcp:us-central1:g2-standard-4:on_demand", source="gcp", region="us-central1",
                        tags={"xroute-pool": "g2"}, **kw)


def test_utilization_from_cloud_monitoring(gcp):
    from datetime import UTC, datetime

    start, end = datetime(2024, 5, 1, 12, tzinfo=UTC), datetime(2024, 5, 1, 12, 30, tzinfo=UTC)
    got = adapter().utilization(_pool(), start, end)
    assert [s.ts.minute for s in got] == [0, 5, 10, 15, 20]  # both pages, in time order
    assert got[0].gpu_util == pytest.approx(0.625) and got[0].cpu_util == pytest.approx(0.21)
    assert got[4].gpu_util == pytest.approx(0.45) and got[4].cpu_util is None
    assert gcp.hits["timeSeries.list"] == 3
    q = next(path for name, _, path in gcp.log if name == "timeSeries.list")
    assert "metadata.user_labels.%22xroute-pool%22+%3D+%22g2%22" in q and "REDUCE_MEAN" in q
    assert "starts_with%28%22us-central1%22%29" in q


def test_utilization_errors_are_retried_or_named(gcp):
    from datetime import UTC, datetime

    gcp.inject("timeSeries.list", Fault.error(503))
    a = adapter()
    t = datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert a.utilization(_pool(), t, t)
    assert a.stats.retries["timeSeries.list"] == 1
    gcp.inject("timeSeries.list", Fault.malformed())
    with pytest.raises(CloudResponseError, match=r"gcp us-central1 timeSeries.list"):
        adapter().utilization(_pool(), t, t)
