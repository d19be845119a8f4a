"""The adapter interface itself: registry, capability maps, retries, lazy SDK imports, isolation."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cloud_adapters import registry
from cloud_adapters.aws import cheapest_over_zones
from cloud_adapters.azure import accelerator_of
from cloud_adapters.base import (
    CloudAdapter,
    Deadline,
    Feature,
    Reader,
    normalize_accelerator,
    retry_after_seconds,
)
from cloud_adapters.collect.config import assign_regions, parse_duration
from cloud_adapters.errors import (
    CloudAuthError,
    CloudResponseError,
    CloudThrottledError,
    CloudUnavailableError,
    SdkMissingError,
    UnknownProviderError,
)
from cloud_adapters.gcp import accelerator_name
from xroute.errors import ConfigError, XrouteError

ROOT = Path(__file__).resolve().parent.parent
SDK_ROOTS = ("boto3", "botocore", "azure", "google.cloud", "moto")


class _Fake(CloudAdapter):
    """A network-free adapter for the shared machinery."""

    name = "fake"

    def api_endpoint(self, region):
        return ("127.0.0.1", 1)

    def _fetch_offerings(self, region):
        self.fetches = getattr(self, "fetches", 0) + 1
        return []

    def _fetch_on_demand_prices(self, region, instance_types):
        return []

    def _fetch_spot_prices(self, region, instance_types, since):
        return []

    def _fetch_quotas(self, region):
        return []


def _fake(**cfg) -> _Fake:
    return _Fake({"backoff_initial_s": 0.01, "backoff_max_s": 0.05, **cfg})


def test_registry_knows_the_providers_and_refuses_others():
    assert {"aws", "azure", "gcp", "replay", "prometheus"} <= set(registry.names())
    assert registry.cloud_names() == ["aws", "azure", "gcp"]
    with pytest.raises(UnknownProviderError, match=r"unknown provider 'ibm' \(known: .*aws"):
        registry.get_adapter("ibm")


@pytest.mark.parametrize("name", ["aws", "azure", "gcp", "prometheus"])
def test_capability_map_covers_every_feature_with_reasons(name):
    caps = registry.get_adapter(name).capabilities()
    assert set(caps) == set(Feature)
    for feature, reason in caps.items():
        assert reason is None or (isinstance(reason, str) and len(reason) > 10), (name, feature)


def test_capabilities_are_data_that_config_can_change():
    off = registry.get_adapter("aws")
    on = registry.get_adapter("aws", {"spot_placement_scores": True})
    assert "spot_placement_scores" in off.capabilities()[Feature.SPOT_AVAILABILITY]
    assert on.supports(Feature.SPOT_AVAILABILITY)
    assert not registry.get_adapter("azure").supports(Feature.UTILIZATION)
    assert registry.get_adapter("aws").supports(Feature.UTILIZATION)
    assert registry.get_adapter("gcp").supports(Feature.UTILIZATION)


def test_importing_the_adapters_imports_no_sdk():
    code = ("import sys, cloud_adapters, cloud_adapters.aws, cloud_adapters.azure, cloud_adapters.gcp, "
            "cloud_adapters.collect.run, cloud_adapters.collect.schedule, cloud_adapters.cli\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'moto') "
            "or m.startswith(('azure.', 'google.cloud')))\nprint(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_a_missing_sdk_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    a = registry.get_adapter("aws")
    with pytest.raises(SdkMissingError) as e:
        a.offerings("us-east-1")
    assert "pip install 'xroute[cloud]'" in str(e.value) and "boto3" in str(e.value)
    assert isinstance(e.value, XrouteError)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_cloud_sdks_are_imported_only_in_cloud_adapters():
    """The rule ruff's TID251 enforces, checked by walking every module's imports too."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "cloud_adapters", "data", "build") or rel.parts[0].startswith("."):
            continue
        if rel.parts[0] == "tests" and (rel.name.startswith("test_cloud_") or rel.name == "clouds.py"):
            continue  # the adapters' own tests seed moto and check translated errors; clouds.py starts moto
        for name in _imports(path):
            if name == "google.cloud" or any(name == r or name.startswith(r + ".") for r in SDK_ROOTS):
                offenders.append(f"{rel}: {name}")
    assert offenders == []


@pytest.mark.parametrize("module", ["boto3", "botocore.exceptions", "azure.mgmt.compute", "google.cloud.compute_v1"])
def test_ruff_bans_sdk_imports_outside_cloud_adapters(module):
    ruff = str(Path(sys.executable).parent / "ruff")
    src = f"import {module}\n"
    outside = subprocess.run([ruff, "check", "--select", "TID251", "--stdin-filename", "xroute/probe.py", "-"],
                             input=src, capture_output=True, text=True, cwd=ROOT)
    assert outside.returncode != 0 and "cloud SDKs are imported only in cloud_adapters/" in outside.stdout
    inside = subprocess.run([ruff, "check", "--select", "TID251", "--stdin-filename", "cloud_adapters/probe.py", "-"],
                            input=src, capture_output=True, text=True, cwd=ROOT)
    assert inside.returncode == 0, inside.stdout


def test_offerings_are_cached_for_their_ttl():
    a = _fake()
    a.offerings("r1")
    a.offerings("r1")
    assert a.fetches == 1
    a.clear_cache()
    a.offerings("r1")
    assert a.fetches == 2


def test_call_retries_transient_errors_then_succeeds():
    a = _fake(max_attempts=4)
    answers = [CloudUnavailableError("fake", "503"), CloudThrottledError("fake", "429"), "ok"]

    def flaky():
        x = answers.pop(0)
        if isinstance(x, Exception):
            raise x
        return x

    assert a.call("Op", "r1", flaky) == "ok"
    assert a.stats.calls["Op"] == 3 and a.stats.retries["Op"] == 2


def test_call_honours_retry_after():
    a = _fake(max_attempts=2)
    answers = [CloudThrottledError("fake", "429", retry_after=0.3), "ok"]

    def throttled():
        x = answers.pop(0)
        if isinstance(x, Exception):
            raise x
        return x

    t0 = time.monotonic()
    assert a.call("Op", "r1", throttled) == "ok"
    assert time.monotonic() - t0 >= 0.3


def test_call_does_not_retry_auth_or_bad_responses():
    a = _fake(max_attempts=5)
    n = [0]

    def denied():
        n[0] += 1
        raise CloudAuthError("fake", "AccessDenied")

    with pytest.raises(CloudAuthError):
        a.call("Op", "r1", denied)
    assert n[0] == 1


def test_call_gives_up_when_the_wait_would_pass_the_deadline():
    a = _fake(max_attempts=10)
    a.deadline = Deadline(0.5)

    def throttled():
        raise CloudThrottledError("fake", "429", retry_after=5.0)

    t0 = time.monotonic()
    with pytest.raises(CloudThrottledError):
        a.call("Op", "r1", throttled)
    assert time.monotonic() - t0 < 0.4
    assert a.stats.calls["Op"] == 1


def test_call_passes_through_unknown_exceptions():
    a = _fake()

    def bug():
        raise KeyError("x")

    with pytest.raises(KeyError):
        a.call("Op", "r1", bug)


def test_reader_names_provider_region_operation_and_field():
    r = Reader("aws", "us-east-1", "GetProducts")
    doc = {"PriceList": [{"terms": {}}]}
    with pytest.raises(CloudResponseError) as e:
        r.get(doc, "PriceList", 0, "terms", "OnDemand")
    assert str(e.value) == "aws us-east-1 GetProducts: missing in the response (field 'PriceList[0].terms.OnDemand')"
    with pytest.raises(CloudResponseError, match=r"'abc' is not a valid float \(field 'x.USD'\)"):
        r.get({"USD": "abc"}, "USD", cast=float, prefix="x")
    assert r.get({}, "a", default=None) is None


def test_retry_after_parses_seconds_and_http_dates():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert retry_after_seconds("soon") is None


def test_accelerator_names_are_shared_across_providers():
    assert normalize_accelerator("NVIDIA A10G") == "A10G"
    assert normalize_accelerator("Tesla V100") == "V100"
    assert accelerator_name("nvidia-tesla-a100") == "A100"
    assert accelerator_name("nvidia-h100-80gb") == "H100"
    assert accelerator_name("A100 80GB") == "A100-80GB"
    assert accelerator_name("Tesla T4") == "T4"
    assert accelerator_of("Standard_NC4as_T4_v3", "standardNCASv3_T4Family") == "T4"
    assert accelerator_of("Standard_NC6s_v3", "standardNCSv3Family") == "V100"


def test_cheapest_over_zones_tracks_the_minimum_at_each_change():
    t = [datetime(2024, 5, 1, h, tzinfo=UTC) for h in range(4)]
    pts = [(t[0], "a", 1.0), (t[0], "b", 0.8), (t[1], "b", 1.2), (t[2], "a", 1.0), (t[3], "a", 0.5)]
    assert cheapest_over_zones(pts) == [(t[0], 0.8), (t[1], 1.0), (t[3], 0.5)]


def test_regions_are_assigned_by_their_spelling():
    got = assign_regions(["aws", "azure", "gcp"], ["us-east-1", "eastus", "us-central1", "aws:eu-west-1"])
    assert got == {"aws": ["us-east-1", "eu-west-1"], "azure": ["eastus"], "gcp": ["us-central1"]}
    with pytest.raises(ConfigError, match="'Mars' matches no provider"):
        assign_regions(["aws"], ["Mars"])
    with pytest.raises(ConfigError, match="no region for gcp"):
        assign_regions(["aws", "gcp"], ["us-east-1"])
    with pytest.raises(ConfigError, match="not in --providers"):
        assign_regions(["aws"], ["gcp:us-central1"])


def test_durations():
    assert parse_duration("10m") == 600 and parse_duration("90") == 90 and parse_duration("1h") == 3600
    with pytest.raises(ConfigError):
        parse_duration("soon")
    with pytest.raises(ConfigError):
        parse_duration("0s")
