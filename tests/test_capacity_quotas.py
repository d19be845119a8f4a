"""Cloud capacity quotas (``envs.capacity``): the bundle's ``quotas`` table masks the offerings no
quota leaves room for one more instance of -- in the environment (and every policy, and ``xroute
evaluate``'s counts) and in the router, whose answers count them as ``quota``."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest

from envs.cloud_route import CloudRouteEnv
from models.baselines import make_baseline
from models.evaluate import run_policy
from router.app.factory import create_app
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, make_setup
from tests.tinybundle import write_serving_yaml, write_tiny_bundle
from xroute.bundle import load_bundle
from xroute.config import EnvConfig, EvaluateConfig, parse_config

T0 = pd.Timestamp("2024-01-01T00:00:00Z")
BLOCKED = "aws:us-east-1:g5.xlarge:on_demand"


def write_quotas(root: Path, free_after_s: float = 30.0) -> Path:
    """A G-family on-demand vCPU quota with 2 vCPUs of room (g5.xlarge takes 4) until
    ``free_after_s``, then 8; an L4 GPU quota with room for one; a quota whose adapter could not
    tell what it covers (it masks nothing, though its limit is 0)."""
    rows = [
        {"ts": (T0 - pd.Timedelta("1h")).isoformat(), "provider": "aws", "region": "us-east-1",
         "quota_name": "Running On-Demand G and VT instances", "unit": "vcpus", "limit": 8, "usage": 6,
         "covers": "aws:us-east-1:g*:on_demand;aws:us-east-1:vt*:on_demand"},
        {"ts": (T0 - pd.Timedelta("1h")).isoformat(), "provider": "azure", "region": "japaneast",
         "quota_name": "cores", "unit": "vcpus", "limit": 0, "usage": None, "covers": None},
        {"ts": (T0 - pd.Timedelta("1h")).isoformat(), "provider": "gcp", "region": "europe-west4",
         "quota_name": "NVIDIA_L4_GPUS", "unit": "gpus", "limit": 1, "usage": 0, "covers": "gcp:europe-west4:g2-*"},
        {"ts": (T0 + pd.Timedelta(seconds=free_after_s)).isoformat(), "provider": "aws", "region": "us-east-1",
         "quota_name": "Running On-Demand G and VT instances", "unit": "vcpus", "limit": 8, "usage": 0,
         "covers": "aws:us-east-1:g*:on_demand;aws:us-east-1:vt*:on_demand"},
    ]
    pd.DataFrame(rows).sort_values(["provider", "region", "quota_name", "ts"]).to_csv(root / "quotas.csv", index=False)
    return root


@pytest.fixture(scope="module")
def quota_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("capacity")
    bundle = write_quotas(write_tiny_bundle(root / "bundle", n_requests=400, preempt=False))
    return bundle, str(write_serving_yaml(root / "serving.yaml"))


def test_the_environment_masks_what_a_quota_leaves_no_room_for(quota_bundle: tuple[Path, str]) -> None:
    path, serving = quota_bundle
    bundle = load_bundle(path)
    assert "covers" in bundle.quotas.columns
    env = CloudRouteEnv(bundle, parse_config(EnvConfig, {"serving_config": serving, "episode_requests": None}))
    blocked = env.offering_index(BLOCKED)
    obs, info = env.reset(seed=0)
    assert env.capacity.active and env.quota_blocked.tolist() == [i == blocked for i in range(env.n)]
    seen_before = seen_after = False
    while True:
        if env.t < T0.timestamp() + 30:
            assert not info["action_mask"][blocked] and env.r_excl_quota == 1
            seen_before = True
        else:
            assert not env.quota_blocked.any() and env.r_excl_quota == 0
            seen_after |= bool(info["action_mask"][blocked])
        obs, _, _, done, info = env.step(int(np.argmax(env.expected_rewards())))
        if done:
            break
    assert seen_before and seen_after
    fresh = CloudRouteEnv(bundle, parse_config(EnvConfig, {"serving_config": serving, "episode_requests": None}))
    fresh.reset(seed=0, options={"start": 0, "end": 1})
    assert not fresh.live_pools(T0.timestamp() + 1.0, fresh.default_model)["valid"][blocked]
    assert fresh.live_pools(T0.timestamp() + 31.0, fresh.default_model)["valid"][blocked]
    m = run_policy(env, make_baseline("lowest-latency", EvaluateConfig()), 0).metrics
    assert m["excluded_quota"] > 0
    # without the covers column (an older bundle) no quota masks anything
    bundle.quotas = bundle.quotas.drop(columns="covers")
    free = CloudRouteEnv(bundle, parse_config(EnvConfig, {"serving_config": serving, "episode_requests": None}))
    free.reset(seed=0)
    assert not free.capacity.active and not free.quota_blocked.any()


def test_the_router_counts_quota_exclusions(quota_bundle: tuple[Path, str], tmp_path: Path) -> None:
    path, _ = quota_bundle
    import shutil

    shutil.copytree(path, tmp_path / "bundle")
    setup = make_setup(tmp_path, replay_speed=1e-6)
    with ServerThread(create_app(setup.settings)) as url:
        got = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=10)
        assert got.status_code == 200, got.text
        d = got.json()
        assert d["excluded"]["by_reason"].get("quota") == 1 and d["offering"]["offering_id"] != BLOCKED
        assert d["excluded"]["total"] >= 1
        offerings = httpx.get(f"{url}/v1/offerings", headers=setup.auth("a"), timeout=10).json()["offerings"]
        assert [o["valid"] for o in offerings if o["offering"]["offering_id"] == BLOCKED] == [False]
        only = {**ROUTE, "constraints": {"allow": [{"offering_ids": [BLOCKED]}]}}
        full = httpx.post(f"{url}/v1/route", json=only, headers=setup.auth("a"), timeout=10)
        assert full.status_code == 429 and full.json()["error"] == "no_capacity"
        assert full.json()["excluded"] == {"request:not_allowed": 5, "quota": 1}

