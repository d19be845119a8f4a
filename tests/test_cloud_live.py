"""Against real cloud accounts: opt-in (XROUTE_LIVE=1 and the provider's credentials), read-only.

    XROUTE_LIVE=1 AWS_PROFILE=... AZURE_SUBSCRIPTION_ID=... GOOGLE_CLOUD_PROJECT=... \\
        .venv/bin/pytest tests/test_cloud_live.py -m live

Regions: XROUTE_LIVE_AWS_REGION (us-east-1), XROUTE_LIVE_AZURE_REGION (eastus),
XROUTE_LIVE_GCP_REGION (us-central1). Every call is a read; the cost is that of the API calls
(see docs/cloud_adapters.md), a few cents at most.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cloud_adapters.collect.commit import read_tables
from cloud_adapters.collect.config import CollectConfig
from cloud_adapters.collect.run import collect_once
from cloud_adapters.registry import get_adapter

pytestmark = pytest.mark.live

OVERRIDES = ("XROUTE_AWS_ENDPOINT_URL", "XROUTE_AZURE_ENDPOINT", "XROUTE_AZURE_PRICES_ENDPOINT", "XROUTE_AZURE_CREDENTIALS",
             "XROUTE_GCP_ENDPOINT", "XROUTE_GCP_BILLING_ENDPOINT", "XROUTE_GCP_CREDENTIALS")


def _aws_ready() -> bool:
    try:
        import boto3

        return boto3.session.Session().get_credentials() is not None
    except Exception:
        return False


def _gcp_ready() -> bool:
    try:
        import google.auth

        google.auth.default()
        return True
    except Exception:
        return False


READY = {
    "aws": _aws_ready,
    "azure": lambda: bool(os.environ.get("AZURE_SUBSCRIPTION_ID")),
    "gcp": _gcp_ready,
}
REGION = {
    "aws": os.environ.get("XROUTE_LIVE_AWS_REGION", "us-east-1"),
    "azure": os.environ.get("XROUTE_LIVE_AZURE_REGION", "eastus"),
    "gcp": os.environ.get("XROUTE_LIVE_GCP_REGION", "us-central1"),
}


@pytest.fixture
def live(monkeypatch):
    if os.environ.get("XROUTE_LIVE") != "1":
        pytest.skip("live cloud tests are opt-in: set XROUTE_LIVE=1 and the provider's credentials")
    for k in OVERRIDES:
        monkeypatch.delenv(k, raising=False)


def _need(provider: str) -> None:
    if not READY[provider]():
        pytest.skip(f"no {provider} credentials found by its standard chain")


@pytest.mark.parametrize("provider", ["aws", "azure", "gcp"])
def test_live_offerings_prices_and_quotas(live, provider):
    _need(provider)
    a = get_adapter(provider)
    region = REGION[provider]
    offers = a.offerings(region)
    assert offers and all(o.accelerator_count > 0 for o in offers)
    types = [o.instance_type for o in offers]
    od = a.on_demand_prices(region, types)
    assert od and all(p.usd_per_hour > 0 for p in od)
    assert a.spot_prices(region, types)
    assert a.quotas(region)
    endpoint = a.api_endpoint(region)
    assert endpoint[1] == 443


def test_live_collection(live, tmp_path: Path):
    ready = [p for p in ("aws", "azure", "gcp") if READY[p]()]
    if not ready:
        pytest.skip("no cloud credentials found")
    out = tmp_path / "bundle"
    report = collect_once(CollectConfig(providers=ready, regions={p: [REGION[p]] for p in ready}, out=out,
                                        origin="local", deadline_s=240))
    assert report.any_ok, report.stale
    assert len(read_tables(out)["offerings"]) > 0
    shutil.rmtree(out)
