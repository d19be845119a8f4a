"""The replay adapter over recorded bundles (a tiny one written here, and the shipped one)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime

import pandas as pd
import pytest

from cloud_adapters.base import Feature, PoolSelector
from cloud_adapters.errors import CloudError, CloudNotSupportedError
from cloud_adapters.registry import get_adapter

T4 = "NC4as_T4_v3"


@pytest.fixture
def bundle(tiny_bundle_dir, tmp_path):
    """The tiny bundle plus a second spot price, quotas and utilization."""
    root = tmp_path / "b"
    shutil.copytree(tiny_bundle_dir, root)
    prices = pd.read_csv(root / "prices.csv")
    later = pd.DataFrame({"ts": ["2024-01-01T06:00:00Z"], "offering_id": [f"azure:japaneast:{T4}:spot"],
                          "usd_per_hour": [0.2]})
    pd.concat([prices, later]).to_csv(root / "prices.csv", index=False)
    pd.DataFrame({"ts": ["2024-01-01T00:00:00Z", "2024-01-01T01:00:00Z"], "provider": ["azure", "azure"],
                  "region": ["japaneast"] * 2, "quota_name": ["standardNCASv3_T4Family"] * 2, "unit": ["vcpus"] * 2,
                  "limit": [24, 48], "usage": [4, ""]}).to_csv(root / "quotas.csv", index=False)
    pd.DataFrame({"ts": ["2024-01-01T00:00:00Z", "2024-01-01T00:05:00Z"],
                  "offering_id": [f"azure:japaneast:{T4}:on_demand"] * 2, "gpu_util": [0.5, 0.7],
                  "cpu_util": [0.1, ""]}).to_csv(root / "utilization.csv", index=False)
    return root


def test_offerings_and_prices_replay_the_recording(bundle):
    a = get_adapter("replay", {"path": str(bundle)})
    offers = a.offerings("azure:japaneast")
    assert [o.instance_type for o in offers] == [T4] and offers[0].provider == "azure"
    assert a.offerings("japaneast") == offers
    od = a.on_demand_prices("japaneast", [T4])
    assert od[0].usd_per_hour == pytest.approx(0.6) and od[0].offering_id == f"azure:japaneast:{T4}:on_demand"
    now = a.spot_prices("japaneast", [T4])
    assert now[0].usd_per_hour == pytest.approx(0.2)
    hist = a.spot_prices("japaneast", [T4], since=datetime(2023, 1, 1, tzinfo=UTC))
    assert [p.usd_per_hour for p in hist] == pytest.approx([0.12, 0.2]) and not hist[0].snapshot


def test_at_fixes_now(bundle):
    a = get_adapter("replay", {"path": str(bundle), "at": "2024-01-01T00:30:00Z"})
    assert a.spot_prices("japaneast", [T4])[0].usd_per_hour == pytest.approx(0.12)
    assert a.quotas("azure:japaneast")[0].limit == 24


def test_quotas_availability_and_utilization(bundle):
    a = get_adapter("replay", {"path": str(bundle)})
    q = a.quotas("japaneast")
    assert len(q) == 1 and q[0].limit == 48 and q[0].usage is None
    pool = PoolSelector(offering_id=f"azure:japaneast:{T4}:on_demand", source="replay")
    u = a.utilization(pool, datetime(2024, 1, 1, tzinfo=UTC), datetime(2024, 1, 2, tzinfo=UTC))
    assert [s.gpu_util for s in u] == [0.5, 0.7] and u[0].cpu_util == 0.1 and u[1].cpu_util is None
    assert a.supports(Feature.SPOT_AVAILABILITY)
    sig = a.spot_availability("aws:us-east-1", ["g5.xlarge"])
    assert all(s.offering_id == "aws:us-east-1:g5.xlarge:spot" for s in sig)


def test_missing_tables_show_in_the_capability_map(tiny_bundle_dir):
    a = get_adapter("replay", {"path": str(tiny_bundle_dir)})
    assert "no quotas table" in a.capabilities()[Feature.QUOTAS]
    with pytest.raises(CloudNotSupportedError, match="no quotas table"):
        a.quotas("japaneast")


def test_unknown_region_names_the_known_ones(tiny_bundle_dir):
    a = get_adapter("replay", {"path": str(tiny_bundle_dir)})
    with pytest.raises(CloudError, match=r"no offerings in 'mars-1'.*aws:us-east-1"):
        a.offerings("mars-1")
    assert a.recorded_rtt().shape[1] == 3
    with pytest.raises(CloudNotSupportedError):
        a.api_endpoint("aws:us-east-1")


def test_default_is_the_shipped_bundle():
    a = get_adapter("replay")
    assert a.regions() and all(":" in loc for loc in a.regions())
    loc = a.regions()[0]
    offers = a.offerings(loc)
    assert offers
    assert a.on_demand_prices(loc, [o.instance_type for o in offers])
