"""The Azure adapter: the real azure-mgmt-compute client and httpx against a local server serving
recorded Resource Manager and Retail Prices payloads (nextLink / NextPageLink paging included)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from cloud_adapters.azure import AzureAdapter
from cloud_adapters.errors import CloudAuthError, CloudResponseError, CloudThrottledError, CloudUnavailableError
from tests.clouds import FIXTURES, Fault, azure_server
from xroute.errors import ConfigError

FAST = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 2.0}
ENV = {"XROUTE_AZURE_CREDENTIALS": "anonymous", "AZURE_SUBSCRIPTION_ID": "00000000-0000-0000-0000-000000000000"}
T4 = "Standard_NC4as_T4_v3"


@pytest.fixture(scope="module")
def server():
    with azure_server() as s:
        yield s


@pytest.fixture
def az(server, monkeypatch):
    server.reset()
    monkeypatch.setenv("XROUTE_AZURE_ENDPOINT", server.url)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    return server


def adapter(**cfg) -> AzureAdapter:
    return AzureAdapter({**FAST, **cfg})


def test_offerings_from_resource_skus_across_pages(az):
    offers = {o.instance_type: o for o in adapter().offerings("westeurope")}
    assert set(offers) == {T4, "Standard_NC8as_T4_v3", "Standard_NC24ads_A100_v4", "Standard_NC40ads_H100_v5",
                           "Standard_NV36ads_A10_v5"}
    assert "Standard_NC6s_v3" not in offers  # NotAvailableForSubscription in the location
    o = offers[T4]
    assert (o.accelerator, o.accelerator_count, o.vcpus, o.memory_gib) == ("T4", 1, 4.0, 28.0)
    assert offers["Standard_NC40ads_H100_v5"].zones == ("2", "3")
    assert az.hits["resource_skus"] == 2
    assert "location%20eq%20%27westeurope%27" in az.log[0][2]


def test_gpu_only_can_be_switched_off(az):
    names = {o.instance_type for o in adapter(gpu_only=False, size_prefixes=["Standard_"]).offerings("eastus")}
    assert "Standard_D4s_v5" in names


def test_retail_prices_split_on_demand_and_spot_and_skip_windows_and_low_priority(az):
    a = adapter()
    od = {p.instance_type: p for p in a.on_demand_prices("eastus", [T4, "Standard_NC24ads_A100_v4"])}
    spot = {p.instance_type: p for p in a.spot_prices("eastus", [T4, "Standard_NC24ads_A100_v4"])}
    assert od[T4].usd_per_hour == pytest.approx(0.526)  # the newest effectiveStartDate, not the 2023 price
    assert spot[T4].usd_per_hour == pytest.approx(0.0789) and spot[T4].pricing_mode == "spot"
    assert od["Standard_NC24ads_A100_v4"].usd_per_hour == pytest.approx(3.673)
    assert az.hits["retail_prices"] == 2  # both pages once: on-demand and spot share the query
    q = az.log[0][2]
    assert "priceType+eq+%27Consumption%27" in q and "armSkuName+eq+%27Standard_NC4as_T4_v3%27" in q


def test_quotas_are_the_gpu_families_and_regional_vcpus_with_usage(az):
    q = {r.quota_name: r for r in adapter().quotas("eastus")}
    assert set(q) == {"cores", "lowPriorityCores", "standardNCASv3_T4Family", "StandardNCADSA100v4Family",
                      "standardNCadsH100v5Family", "StandardNVADSA10v5Family"}
    assert (q["standardNCASv3_T4Family"].limit, q["standardNCASv3_T4Family"].usage) == (24, 4)
    assert all(r.unit == "vcpus" for r in q.values())
    # what each counts: the region's standard or spot vCPUs, a family's on-demand sizes (resource SKUs)
    assert q["cores"].covers == ("azure:eastus:*:on_demand",)
    assert q["lowPriorityCores"].covers == ("azure:eastus:*:spot",)
    t4 = q["standardNCASv3_T4Family"].covers
    assert t4 and all(c.startswith("azure:eastus:Standard_NC") and "T4" in c and c.endswith(":on_demand") for c in t4)


def test_arm_throttling_is_retried_after_retry_after(az):
    az.inject("resource_skus", Fault.throttle(retry_after=0.3))
    a = adapter()
    t0 = time.monotonic()
    assert a.offerings("eastus")
    assert time.monotonic() - t0 >= 0.3
    assert a.stats.retries["ResourceSkus.List"] == 1 and az.hits["resource_skus"] == 3


def test_a_failed_second_page_is_asked_for_again(az):
    a = adapter()
    original = az.routes[0].respond
    calls = {"n": 0}

    def flaky(req, s):
        calls["n"] += 1
        if calls["n"] == 2:  # the nextLink page fails once
            return type(original(req, s))(503, b'{"error": {"code": "ServiceUnavailable", "message": "x"}}')
        return original(req, s)

    az.routes[0].respond = flaky
    try:
        assert len(a.offerings("eastus")) == 5
    finally:
        az.routes[0].respond = original
    assert a.stats.retries["ResourceSkus.List"] == 1
    assert "skiptoken" in az.log[1][2] and "skiptoken" in az.log[2][2]


@pytest.mark.parametrize("fault", [Fault.error(500), Fault.error(503), Fault.truncate()], ids=["500", "503", "truncated"])
def test_transient_failures_on_usages_are_retried(az, fault):
    az.inject("usages", fault)
    a = adapter()
    assert a.quotas("eastus")
    assert a.stats.retries["Usage.List"] == 1


def test_stall_past_the_timeout_is_retried(az):
    az.inject("retail_prices", Fault.stall(1.2))
    a = adapter(timeout_s=0.4)
    assert a.on_demand_prices("eastus", [T4])
    assert a.stats.retries["RetailPrices"] == 1


def test_truncated_retail_page_is_retried(az):
    az.inject("retail_prices", Fault.truncate())
    a = adapter()
    assert a.spot_prices("eastus", [T4])
    assert a.stats.retries["RetailPrices"] == 1


def test_malformed_retail_body_names_provider_region_and_operation(az):
    az.inject("retail_prices", Fault.malformed())
    with pytest.raises(CloudResponseError) as e:
        adapter().on_demand_prices("eastus", [T4])
    assert str(e.value).startswith("azure eastus RetailPrices: the response body is not JSON")


def test_malformed_arm_body_is_a_clear_error(az):
    az.inject("usages", Fault.malformed())
    with pytest.raises(CloudResponseError, match=r"azure eastus Usage.List"):
        adapter().quotas("eastus")


def test_persistent_throttling_ends_in_a_clear_error(az):
    az.inject("usages", *[Fault.throttle(retry_after=0)] * 2)
    with pytest.raises(CloudThrottledError, match=r"azure northeurope Usage.List"):
        adapter(max_attempts=2).quotas("northeurope")


def test_forbidden_is_an_auth_error_with_a_fix(az):
    az.inject("resource_skus", Fault.error(403))
    with pytest.raises(CloudAuthError, match="to fix: grant the identity Reader"):
        adapter().offerings("eastus")


def test_missing_fields_are_named(az, tmp_path, monkeypatch):
    fx = tmp_path / "fx"
    shutil.copytree(FIXTURES, fx)
    p = fx / "azure" / "retail_prices.page1.json"
    doc = json.loads(p.read_text())
    del doc["Items"][1]["retailPrice"]
    p.write_text(json.dumps(doc))
    u = fx / "azure" / "usages.json"
    doc = json.loads(u.read_text())
    del doc["value"][4]["limit"]
    u.write_text(json.dumps(doc))
    with azure_server(fx) as srv:
        monkeypatch.setenv("XROUTE_AZURE_ENDPOINT", srv.url)
        with pytest.raises(CloudResponseError) as e:
            adapter().spot_prices("eastus", [T4])
        assert e.value.field == "Items[1].retailPrice" and e.value.region == "eastus"
        with pytest.raises(CloudResponseError) as e:
            adapter().quotas("eastus")
        assert e.value.field == "value[4].limit"


def test_unreachable_endpoint_is_unavailable(monkeypatch):
    monkeypatch.setenv("XROUTE_AZURE_ENDPOINT", "http://127.0.0.1:9")
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(CloudUnavailableError, match=r"azure eastus ResourceSkus.List"):
        adapter(max_attempts=1).offerings("eastus")


def test_anonymous_credentials_only_for_a_local_endpoint(monkeypatch):
    monkeypatch.delenv("XROUTE_AZURE_ENDPOINT", raising=False)
    monkeypatch.setenv("XROUTE_AZURE_CREDENTIALS", "anonymous")
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "x")
    with pytest.raises(ConfigError, match="only for a local endpoint"):
        adapter().offerings("eastus")


def test_a_subscription_is_required(az, monkeypatch):
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID")
    with pytest.raises(ConfigError, match="AZURE_SUBSCRIPTION_ID"):
        adapter().offerings("eastus")


def test_api_endpoint_is_regional_arm(monkeypatch):
    monkeypatch.delenv("XROUTE_AZURE_ENDPOINT", raising=False)
    assert adapter().api_endpoint("eastus") == ("eastus.management.azure.com", 443)
