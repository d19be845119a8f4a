"""The capacity plan in the service (issue 37, item 4): ``xroute plan`` as a user runs it (the shipped
bundle, two baselines, a learned planner registered in a temporary MLflow store, bad input),
``GET /v1/capacity/plan`` over a real HTTP server, and the pools following the bundle's
``inventory`` table -- in the routing environment (hand-computed on the tiny bundle), in the
router's answers and in the plan's ``current``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest

from envs.cloud_route import CloudRouteEnv
from models.baselines import make_baseline
from models.capacity_plan import PlanMaker
from models.planners import PLANNERS
from router.app.factory import create_app
from router.core import settings as router_settings
from router.core.settings import load_settings
from tests.capbundle import OD, OD_AZ, SPOT, write_capbundle
from tests.servers import ServerThread
from tests.test_router_support import ROUTE, make_setup
from tests.tinybundle import write_serving_yaml, write_tiny_bundle
from xroute.bundle import load_bundle, to_seconds
from xroute.config import CapacityConfig, EnvConfig, parse_config
from xroute.errors import ConfigError
from xroute.schema.capacity import CapacityPlan

REPO = Path(__file__).resolve().parent.parent
T0 = pd.Timestamp("2024-01-01T00:00:00Z")
#: the tiny bundle's pools the inventory sizes: A runs 3 instances, then none from T0 + 30 s; G runs one
A, G = "aws:us-east-1:g5.xlarge:on_demand", "gcp:europe-west4:g2-standard-4:on_demand"


def xroute(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xroute_app", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=300)


def one_line(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def write_inventory(bundle: Path) -> Path:
    pd.DataFrame([{"ts": (T0 - pd.Timedelta("1h")).isoformat(), "offering_id": A, "running": 3},
                  {"ts": (T0 + pd.Timedelta(seconds=30)).isoformat(), "offering_id": A, "running": 0},
                  {"ts": (T0 - pd.Timedelta("1h")).isoformat(), "offering_id": G, "running": 1}]
                 ).to_csv(bundle / "inventory.csv", index=False)
    return bundle


# ------------------------------------------------------------------------------------------ xroute plan
def test_xroute_plan_on_the_shipped_bundle_with_two_baselines(tmp_path: Path) -> None:
    bundle = load_bundle()
    last = pd.Timestamp(to_seconds(bundle.workload["ts"])[-1], unit="s", tz="UTC")
    plans = {}
    for name in ("spothedge", "melange"):
        out = tmp_path / f"{name}.json"
        p = xroute("plan", "--policy", name, "--output", str(out))
        assert p.returncode == 0, p.stderr
        assert f"xroute plan -- {name}" in p.stdout and "target" in p.stdout
        plan = CapacityPlan.model_validate_json(out.read_text())
        assert plan.planner == name and abs((pd.Timestamp(plan.at) - last).total_seconds()) < 1e-3
        assert len(plan.pools) == len(bundle.offerings) and all(x.current is None for x in plan.pools)
        assert sum(x.target for x in plan.pools) > 0
        held = sum(x.target * (x.reasons.usd_per_hour or 0.0) for x in plan.pools)
        assert plan.usd_per_hour == pytest.approx(held, abs=1e-5)
        fc = {x.reasons.forecast_rps for x in plan.pools}
        assert len(fc) == 1 and next(iter(fc)) > 0  # (one model: one forecast)
        assert all((x.reasons.hazard_per_hour is not None) == x.offering_id.endswith(":spot") for x in plan.pools)
        plans[name] = plan
    # Mélange holds no spot (include_spot: false); SpotHedge does
    spot = {n: sum(x.target for x in p.pools if x.offering_id.endswith(":spot")) for n, p in plans.items()}
    assert spot["melange"] == 0 and spot["spothedge"] > 0


def test_bad_input_to_xroute_plan_is_one_line_naming_the_option(tmp_path: Path) -> None:
    one_line(xroute("plan", "--policy", "no-such-planner"), "--policy", "unknown planner")
    one_line(xroute("plan", "--policy", "oracle"), "--policy", "hindsight")
    one_line(xroute("plan", "--at", "yesterday"), "--at", "ISO-8601")
    one_line(xroute("plan", "--at", "2001-01-01T00:00:00Z"), "--at", "before the telemetry's first request")
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    one_line(xroute("plan", "--policy", "models:/xroute-planner@champion", env=store), "--policy",
             "cannot load 'models:/xroute-planner@champion'")
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_xroute_plan_with_a_learned_planner_registered_in_mlflow(tmp_path: Path) -> None:
    import mlflow

    from models import registry
    from models.planner_net import save_planner
    from models.planner_policy import LearnedPlanner
    from models.planner_pyfunc import example_row
    from models.planner_trainer import log_planner_model
    from tests.test_planner_learned import random_weights

    weights = random_weights(3, margin=0.2, hazard_price=0.5)
    export = save_planner(weights, tmp_path / "export")
    bundle = load_bundle()
    at = float(to_seconds(bundle.workload["ts"])[-1])
    local = PlanMaker(bundle, str(export))
    ctx, view = local.world.decision_view(at)
    lp = LearnedPlanner(CapacityConfig().planners, weights)
    lp.reset(ctx)
    example = pd.DataFrame([example_row(lp.step(view), view, local.world.pools, local.world.R)])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    prior = mlflow.get_tracking_uri()  # (MLflow's process-wide settings: left as they were for the other tests)
    mlflow.set_tracking_uri(uri)
    try:
        experiment = mlflow.MlflowClient(uri).create_experiment("plan-test")  # (no set_experiment: it is global)
        with mlflow.start_run(experiment_id=experiment):
            info = log_planner_model(export, example)
        registry.register(info.model_uri, "xroute-planner", "champion")
    finally:
        mlflow.set_tracking_uri(prior)
    out = tmp_path / "plan.json"
    p = xroute("plan", "--policy", "models:/xroute-planner@champion", "--output", str(out),
               env={"MLFLOW_TRACKING_URI": uri})
    assert p.returncode == 0, p.stderr
    plan = CapacityPlan.model_validate_json(out.read_text())
    assert plan.planner == "models:/xroute-planner@champion"
    # the registered model plans what its export plans, from the same view
    want = local.plan(at)
    assert [x.target for x in plan.pools] == [x.target for x in want.pools] and sum(x.target for x in want.pools) > 0
    assert all("effective price" in x.reasons.note or "not eligible" in x.reasons.note for x in plan.pools)
    one_line(xroute("plan", "--policy", "models:/xroute-planner@challenger", env={"MLFLOW_TRACKING_URI": uri}),
             "--policy", "cannot load")


def test_the_plan_reads_the_inventory_at_its_time_and_nothing_after(tmp_path: Path) -> None:
    root = write_capbundle(tmp_path / "cap", [{"t": float(t)} for t in range(0, 300, 2)])
    pd.DataFrame([{"ts": (T0 - pd.Timedelta("1h")).isoformat(), "offering_id": OD, "running": 2, "launching": 1},
                  {"ts": (T0 + pd.Timedelta(seconds=100)).isoformat(), "offering_id": OD, "running": 5},
                  {"ts": (T0 + pd.Timedelta(seconds=10)).isoformat(), "offering_id": SPOT, "running": 1},
                  {"ts": (T0 + pd.Timedelta(seconds=500)).isoformat(), "offering_id": OD_AZ, "running": 4}]
                 ).to_csv(root / "inventory.csv", index=False)
    cfg = parse_config(CapacityConfig, {"world": {"serving_config": str((root / "serving.yaml").resolve())}})
    maker = PlanMaker(load_bundle(root), "autoscaler", cfg)
    at = (T0 + pd.Timedelta(seconds=50)).timestamp()
    plan = maker.plan(at)
    cur = {x.offering_id: x.current for x in plan.pools}
    assert cur[OD] == 2 and cur[SPOT] == 1 and cur[OD_AZ] is None  # (its row comes after the plan)
    assert sum(v is None for v in cur.values()) == len(cur) - 2
    _, view = maker.world.decision_view(at)
    k = maker.world.pool_index[f"{maker.world.model_names[0]}@{OD}"]
    assert view.ready[k] == 2 and view.launching[k] == 1  # what the planner starts from
    later = {x.offering_id: x.current for x in maker.plan((T0 + pd.Timedelta(seconds=150)).timestamp()).pools}
    assert later[OD] == 5 and later[OD_AZ] is None


# ------------------------------------------------------------------------------------------ the router
def test_a_bad_planner_setting_is_a_config_error_naming_the_field() -> None:
    assert set(router_settings._PLANNERS) == set(PLANNERS) - {"oracle"}
    for block, field in (({"planner": "no-such"}, "capacity.planner"), ({"planner": "oracle"}, "capacity.planner"),
                         ({"epoch_s": 0}, "capacity.epoch_s"), ({"epoch": 60}, "capacity.epoch")):
        with pytest.raises(ConfigError, match=f"field '{field}'"):
            load_settings(None, capacity=block)
    assert load_settings(None, capacity={"planner": "models:/xroute-planner@champion"}).capacity.epoch_s == 60


def test_get_capacity_plan_over_http(tmp_path: Path) -> None:
    write_inventory(write_tiny_bundle(tmp_path / "r" / "bundle"))
    setup = make_setup(tmp_path / "r", replay_speed=1e-6, replay_offset_s=70.0)
    with ServerThread(create_app(setup.settings)) as url:
        got = httpx.get(f"{url}/v1/capacity/plan", headers=setup.auth("admin"), timeout=120)
        assert got.status_code == 200, got.text
        plan = CapacityPlan.model_validate(got.json())
        assert plan.planner == "spothedge" and pd.Timestamp(plan.at) == T0 + pd.Timedelta(seconds=60)
        assert plan.source.startswith("replay:") and plan.epoch_s == 60
        cur = {x.offering_id: x.current for x in plan.pools}
        assert cur[A] == 0 and cur[G] == 1 and sum(v is None for v in cur.values()) == len(cur) - 2
        again = httpx.get(f"{url}/v1/capacity/plan", headers=setup.auth("admin"), timeout=60)
        assert again.json() == got.json()  # (the epoch's plan, cached)
        denied = httpx.get(f"{url}/v1/capacity/plan", headers=setup.auth("a"), timeout=10)
        assert denied.status_code == 403 and denied.json()["missing_permission"] == "admin:read:capacity"
        assert httpx.get(f"{url}/v1/capacity/plan", timeout=10).status_code == 401
        # the pools follow the inventory: A has no instance at the replay's time (T0 + 70 s)
        r = httpx.post(f"{url}/v1/route", json=ROUTE, headers=setup.auth("a"), timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["offering"]["offering_id"] != A and r.json()["excluded"]["by_reason"].get("no_capacity", 0) >= 1
        offs = {o["offering"]["offering_id"]: o for o in
                httpx.get(f"{url}/v1/offerings", headers=setup.auth("a"), timeout=10).json()["offerings"]}
        assert not offs[A]["valid"] and offs[G]["valid"]
        only = {**ROUTE, "constraints": {"allow": [{"offering_ids": [A]}]}}
        full = httpx.post(f"{url}/v1/route", json=only, headers=setup.auth("a"), timeout=10)
        assert full.status_code == 429 and full.json()["error"] == "no_capacity"  # (not 422: the pool exists)
        ex = httpx.post(f"{url}/v1/explain", json=ROUTE, headers=setup.auth("a"), timeout=10)
        assert ex.status_code == 200, ex.text
        why = {o["offering"]["offering_id"]: o for o in ex.json()["offerings"]}[A]
        assert not why["eligible"] and why["excluded_by"] == "no_capacity"


def test_a_planner_that_cannot_plan_is_a_503_with_a_json_body(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    setup = make_setup(tmp_path / "r", replay_speed=1e-6, replay_offset_s=70.0,
                       capacity={"planner": "models:/xroute-planner@champion"})
    with ServerThread(create_app(setup.settings)) as url:
        got = httpx.get(f"{url}/v1/capacity/plan", headers=setup.auth("admin"), timeout=60)
        assert got.status_code == 503 and got.json()["error"] == "plan_unavailable"
        assert "models:/xroute-planner@champion" in got.json()["message"] and "cannot load" in got.json()["message"]
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200  # (the router itself serves on)
    # the first epoch of a replay has no request before it: the forecast has nothing to read
    first = make_setup(tmp_path / "f", replay_speed=1e-6, replay_offset_s=0.0)
    with ServerThread(create_app(first.settings)) as url:
        got = httpx.get(f"{url}/v1/capacity/plan", headers=first.auth("admin"), timeout=60)
        assert got.status_code == 503 and "before the telemetry's first request" in got.json()["message"]


# ------------------------------------------------------------------------------------------ inventory in the env
def test_the_pools_follow_the_inventory_in_the_environment(tmp_path: Path) -> None:
    """Hand-computed on the tiny bundle (one-GPU instances; the default model's replica spans one GPU):
    A10G replicas have 7 slots, L4 7, T4 1. The catalog gives A 2 replicas (14 slots) and G 2 (14);
    the inventory gives A 3 instances (21 slots) until T0 + 30 s, then none (masked), and G one (7)."""
    bundle = write_inventory(write_tiny_bundle(tmp_path / "bundle", n_requests=400, preempt=False))
    serving = str(write_serving_yaml(tmp_path / "serving.yaml"))
    cfg = parse_config(EnvConfig, {"serving_config": serving, "episode_requests": None})
    env = CloudRouteEnv(load_bundle(bundle), cfg)
    a, g = env.offering_index(A), env.offering_index(G)
    assert env.slots_alloc[0, a] == 21 and env.slots_alloc[0, g] == 14
    _, info = env.reset(seed=0)
    before = after = 0
    while True:
        if env.t < T0.timestamp() + 30:
            assert env.slots[0, a] == 21 and env.slots[0, g] == 7
            before += 1
        else:
            assert env.slots[0, a] == 0 and not info["action_mask"][a] and env.slots[0, g] == 7
            after += 1
        _, _, _, done, info = env.step(int(np.argmax(np.where(info["action_mask"][: env.n], env.expected_rewards(),
                                                               -np.inf))))
        if done:
            break
    assert before > 50 and after > 200
    assert env.live_pools(T0.timestamp() + 10, 0)["slots"][a] == 21
    assert env.live_pools(T0.timestamp() + 40, 0)["slots"][a] == 0
    # the baselines see the same pools: none sends a request to A once it has no instance (whenever
    # anything is valid; a request nothing can take fails wherever it is sent)
    for name in ("lowest-latency", "greedy"):
        benv, pol = CloudRouteEnv(load_bundle(bundle), cfg), make_baseline(name, cfg_eval())
        obs, info = benv.reset(seed=0)
        pol.reset(benv, 0)
        early = 0
        while True:
            act = pol.act(obs, info)
            if benv.t >= T0.timestamp() + 30 and info["action_mask"][: benv.n].any():
                assert act != a
            early += act == a and benv.t < T0.timestamp() + 30
            obs, _, _, done, info = benv.step(act)
            if done:
                break
        assert early > 0
    # without the table, the catalog's sizes hold throughout
    (bundle / "inventory.csv").unlink()
    plain = CloudRouteEnv(load_bundle(bundle), cfg)
    plain.reset(seed=0)
    assert plain.slots[0, a] == 14 and plain.slots[0, g] == 14 and not plain.inventory.active


def cfg_eval():  # type: ignore[no-untyped-def]
    from xroute.config import EvaluateConfig

    return EvaluateConfig()
