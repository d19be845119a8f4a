"""The learned capacity planner's parts without Ray: the allocation against brute force, the zero
network's plan on a hand-made bundle, the export and its bad forms, the registered model's
``predict`` against the planner itself, the gate's verdict on toy results, and bad ``--policy``
input as a user meets it."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from envs.provisioning import ProvisionWorld
from models.capacity_eval import PlannerResult, PlannerRun
from models.planner_gate import ORACLE, WindowResult, best_baseline, decide, markdown
from models.planner_net import N_CONTEXT, N_POOL, Knobs, PlannerWeights, allocate, read_planner, save_planner
from models.planner_policy import LearnedPlanner, load_planner, planner_factory
from tests.capbundle import OD, OD_AZ, SPOT, SPOT_AZ, SPOT_W, T0, write_capbundle
from xroute.config import PlannersConfig
from xroute.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def random_weights(seed: int = 0, **knobs: Any) -> PlannerWeights:
    """A planner with a random two-layer network (every feature reaches the output) and ``knobs``."""
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, 0.5, (N_POOL + N_CONTEXT, 8))
    w1 = rng.normal(0, 0.5, (8, 2))
    return PlannerWeights([(w0, rng.normal(0, 0.1, 8)), (w1, np.zeros(2))], Knobs(**knobs))


# ------------------------------------------------------------------------------------------ the allocation
def _brute(cap, eff, price, launch, held, ub, need, spot, hedge, horizon):  # type: ignore[no-untyped-def]
    best, arg = np.inf, None
    for xs in itertools.product(*[range(int(u) + 1) for u in ub]):
        x = np.array(xs, dtype=float)
        tot = float(cap @ x)
        if tot < need - 1e-9:
            continue
        if hedge > 0 and any(tot - cap[q] * x[q] < hedge * need - 1e-9 for q in np.flatnonzero(spot)):
            continue
        c = float(np.sum(x * eff * horizon + price * launch * np.maximum(x - held, 0.0))) / 3600.0
        if c < best - 1e-12:
            best, arg = c, x
    return best, arg


@pytest.mark.parametrize("seed", range(12))
def test_the_allocation_is_the_cheapest_cover(seed: int) -> None:
    """``allocate`` against every integer plan: covers the demand (and, with a hedge, the demand's
    share after losing any one spot pool) at the lowest effective holding plus launch cost."""
    rng = np.random.default_rng(seed)
    n = 3
    cap = rng.uniform(0.5, 3.0, n).round(2)
    price = rng.uniform(0.3, 4.0, n).round(2)
    eff = price * np.exp(rng.normal(0, 0.7, n))
    launch = rng.choice([120.0, 230.0, 530.0], n)
    held = rng.integers(0, 3, n).astype(float)
    ub = np.maximum(held, rng.integers(1, 5, n)).astype(float)
    spot = rng.random(n) < 0.6
    hedge = float(rng.choice([0.0, 0.5]))
    need = float(rng.uniform(0.3, 0.8) * (cap @ ub) * (0.6 if hedge else 1.0))
    x = allocate(cap, eff, price, launch, held, ub, need, spot, hedge, 600.0)
    want, _ = _brute(cap, eff, price, launch, held, ub, need, spot, hedge, 600.0)
    if not np.isfinite(want):  # (a hedge the pools cannot give: plain coverage)
        want, _ = _brute(cap, eff, price, launch, held, ub, need, spot, 0.0, 600.0)
    got = float(np.sum(x * eff * 600.0 + price * launch * np.maximum(x - held, 0.0))) / 3600.0
    assert float(cap @ x) >= need - 1e-9 and np.all(x <= ub)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_the_allocation_holds_everything_when_the_demand_is_out_of_reach() -> None:
    x = allocate(np.array([1.0, 2.0]), np.ones(2), np.ones(2), np.zeros(2), np.zeros(2), np.array([3.0, 1.0]), 100.0,
                 np.array([True, False]), 0.0, 600.0)
    assert x.tolist() == [3, 1]


# ------------------------------------------------------------------------------------------ on a hand-made world
def _history(n: int, span_s: float = 60.0) -> pd.DataFrame:
    ts = [T0 - pd.Timedelta(seconds=span_s) + pd.Timedelta(seconds=span_s * (k + 0.5) / n) for k in range(n)]
    return pd.DataFrame({"ts": ts, "request_id": [f"h{k}" for k in range(n)], "origin": "aws:us-east-1",
                         "input_tokens": 1000, "output_tokens": 100, "tenant": "a"})


@pytest.fixture
def toy(tmp_path: Path) -> ProvisionWorld:
    """3 requests a second before the window; one instance serves 2 slots / 2 s x 0.8 = 0.8 a second.
    SPOT_AZ's trace records a preemption 10 minutes before the window (its hazard is the highest)."""
    root = write_capbundle(tmp_path, [{"t": k * 20.0} for k in range(60)],
                           availability={SPOT_AZ: [(-600.0, 0), (-500.0, 1)]})
    return ProvisionWorld(str(root), {"serving_config": str((root / "serving.yaml").resolve()), "spot_lag_s": 0.0},
                          history=_history(180))


def test_the_zero_network_holds_the_cheapest_cover_and_prices_the_hazard(toy: ProvisionWorld) -> None:
    """Need 3 requests/s = 4 instances of 0.8: all spot (a tenth of the on-demand price). With a hazard
    price, the pool whose trace recorded a preemption costs more and the others take the load; with a
    hedge of 1/2, losing any one spot pool leaves half the demand."""
    w = toy
    idx = {o: w.pool_index[f"llama-2-7b@{o}"] for o in (OD, OD_AZ, SPOT, SPOT_W, SPOT_AZ)}
    v = None

    def plan(**knobs: Any) -> np.ndarray:
        nonlocal v
        lp = LearnedPlanner(PlannersConfig(), PlannerWeights(knobs=Knobs(margin=0.0, **knobs)))
        lp.reset(w.reset(seed=0))
        v = w.view()
        return lp.plan(v)

    out = plan()
    assert out.sum() == 4 and out[idx[OD]] == out[idx[OD_AZ]] == 0
    assert v is not None and v.hazard[idx[SPOT_AZ]] > v.hazard[idx[SPOT]] > 0
    out = plan(hazard_price=2.0)
    assert out[idx[SPOT_AZ]] == 0 and out[idx[SPOT]] + out[idx[SPOT_W]] == 4
    out = plan(hazard_price=2.0, hedge=0.5)
    caps = 0.8 * out
    assert out.sum() >= 4 and all(caps.sum() - caps[idx[o]] >= 1.5 - 1e-9 for o in (SPOT, SPOT_W, SPOT_AZ))


def test_the_relaunch_loss_prices_a_preemption_by_what_it_costs_not_by_the_pools_price() -> None:
    """On demand 4 USD/h for 2 requests/s (2 USD/h per request/s); spot A 0.4 USD/h with 3 preemptions
    an hour, spot B 1.6 USD/h with none, both 2 requests/s, 240-s launches. One preemption of A costs
    its 2 requests/s on demand for 240 s: 2 x 240 / 3600 x 2 = 0.267 USD, x 3 an hour = 0.8 USD/h -- so
    A at 1.2 USD/h effective is still cheaper than B and is held; the multiplicative hazard price
    (0.4 x e^3 = 8.0 USD/h) drops it for B. Without an eligible on-demand pool the reference is the
    cheapest eligible pool's price per request/s."""
    from models.planner_net import plan_targets, relaunch_loss_h

    price = np.array([4.0, 0.4, 1.6])
    cap = np.full(3, 2.0)
    launch = np.full(3, 240.0)
    spot = np.array([False, True, True])
    hz = np.array([0.0, 3.0, 0.0])
    elig = np.ones(3, dtype=bool)
    loss = relaunch_loss_h(hz, price, cap, launch, spot, elig)
    assert np.allclose(loss, [0.0, 0.8, 0.0])
    assert np.allclose(relaunch_loss_h(hz, price, cap, launch, spot, np.array([False, True, True])), [0.0, 0.08, 0.0])

    def targets(**knobs: Any) -> np.ndarray:
        w = PlannerWeights(knobs=Knobs(margin=0.0, horizon_s=3600.0, **knobs))
        x, g = np.zeros((3, N_POOL)), np.zeros(N_CONTEXT)
        return plan_targets(w, x, g, spot, hz, price, cap, launch, np.ones(3), np.full(3, 4.0), elig, 2.0)[1]

    assert targets(relaunch_price=1.0).tolist() == [0, 1, 0]
    assert targets(hazard_price=1.0).tolist() == [0, 0, 1]
    assert targets(relaunch_price=3.0).tolist() == [0, 0, 1]  # 0.4 + 2.4 > 1.6


def test_a_spot_pool_with_trouble_of_its_own_is_not_eligible_for_cooldown_epochs(toy: ProvisionWorld) -> None:
    w = toy
    lp = LearnedPlanner(PlannersConfig(), PlannerWeights(knobs=Knobs(margin=0.0, cooldown=2)))
    lp.reset(w.reset(seed=0))
    v = w.view()
    p = w.pool_index[f"llama-2-7b@{SPOT}"]
    failed = np.zeros(w.P, dtype=np.int64)
    failed[p] = 1
    st = lp.step(replace(v, failed_launches=failed))
    assert not st.eligible[p] and st.targets[p] == 0
    st = lp.step(replace(v, t=v.t + 60, epoch=1))  # one epoch after: still cooling down
    assert not st.eligible[p]
    st = lp.step(replace(v, t=v.t + 120, epoch=2))
    assert st.eligible[p]


# ------------------------------------------------------------------------------------------ the export
def test_the_export_round_trips_and_bad_exports_name_the_problem(tmp_path: Path) -> None:
    w = random_weights(3, margin=0.2, hedge=0.3, risk_price=1.5)
    d = save_planner(w, tmp_path / "p")
    r = read_planner(tmp_path)  # (found below the directory given, as in a downloaded model)
    assert r.knobs == w.knobs and len(r.layers) == 2
    x, g = np.random.default_rng(0).random((5, N_POOL)), np.random.default_rng(1).random(N_CONTEXT)
    spot = np.array([True, False, True, True, False])
    assert np.array_equal(r.heads(x, g, spot)[1], w.heads(x, g, spot)[1])
    assert r.heads(x, g, spot)[0][1] == 0.0  # an on-demand pool is never at risk
    meta = json.loads((d / "planner.json").read_text())
    for bad, msg in (({**meta, "format": "other/1"}, "field 'format'"),
                     ({**meta, "pool_features": ["price"]}, "another feature layout"),
                     ({**meta, "knobs": {**meta["knobs"], "hedge": 3.0}}, "field 'hedge'"),
                     ({**meta, "knobs": {**meta["knobs"], "speed": 1}}, "field 'knobs'")):
        (d / "planner.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=msg):
            read_planner(d)
    (d / "planner.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_planner(d)
    (d / "planner.json").write_text(json.dumps(meta))
    (d / "planner.npz").unlink()
    with pytest.raises(ConfigError, match=r"planner\.npz is missing"):
        read_planner(d)
    with pytest.raises(ConfigError, match="not an exported planner"):
        read_planner(tmp_path / "nothing-here")
    with pytest.raises(ConfigError, match="unknown planner 'greedy'"):
        planner_factory("greedy")


def test_the_registered_models_predict_is_the_planners_plan() -> None:
    """``models.planner_pyfunc.predict_frame`` on a plan's input gives the planner's own targets."""
    from models.config import load_train_config
    from models.planner_pyfunc import example_row, predict_frame
    from models.scenarios import split_bundle
    from xroute.bundle import load_bundle

    sp = split_bundle(load_bundle(), load_train_config(None).split)
    w = ProvisionWorld(sp.bundles["validation"], history=sp.history("validation"), load_scale=2)
    weights = random_weights(1, margin=0.1, hedge=0.4, risk_price=1.0, hazard_price=0.5, stabilization_s=120)
    lp = LearnedPlanner(PlannersConfig(), weights)
    lp.reset(w.reset(seed=0))
    rows, want = [], []
    for e in range(4):
        v = w.view()
        st = lp.step(v)
        rows.append(example_row(st, v, w.pools, w.R, plan_id=f"e{e}"))
        want.append(st.targets.tolist())
        w.step(st.targets)
    out = predict_frame(weights, pd.DataFrame(rows))
    assert out["plan_id"].tolist() == ["e0", "e1", "e2", "e3"] and out["targets"].tolist() == want
    assert sum(map(sum, want)) > 0
    with pytest.raises(ValueError, match="expected"):
        predict_frame(weights, pd.DataFrame([{**rows[0], "context": [1.0]}]))


# ------------------------------------------------------------------------------------------ the gate
def _result(name: str, costs: list[float], slo: float = 1.0) -> PlannerResult:
    runs = [PlannerRun(name, {"cost_usd": c, "slo_attainment": slo, "requests": 1000, "cost_per_1k_requests": c},
                       np.zeros((1, 1)), np.zeros((1, 1))) for c in costs]
    return PlannerResult(name, runs, metrics={"cost_usd": float(np.mean(costs)), "slo_attainment": slo,
                                              "cost_per_1k_requests": float(np.mean(costs))})


def _window(label: str, cand: list[float], cand_slo: float = 1.0, spothedge: list[float] | None = None,
            spothedge_slo: float = 1.0) -> WindowResult:
    res = [_result("static-ondemand", [1.0, 1.0, 1.0]), _result("autoscaler", [0.9, 0.9, 0.9], slo=0.5),
           _result("spothedge", spothedge or [0.4, 0.41, 0.39], slo=spothedge_slo), _result("melange", [0.6, 0.6, 0.6]),
           _result(ORACLE, [0.1, 0.1, 0.1]), _result("planner", cand, slo=cand_slo)]
    return WindowResult(label, res, best_baseline(res, 0.02))


def test_the_gate_passes_a_planner_cheaper_everywhere_within_the_slo() -> None:
    wins = [_window("a x1", [0.2, 0.21, 0.19]), _window("b x4", [0.3, 0.31, 0.3])]
    assert wins[0].best_baseline == "spothedge"  # the cheapest baseline meeting the SLO (not the autoscaler at 50 %)
    d = decide(wins, "planner")
    assert d.passed and d.wins == ["a x1", "b x4"] and d.pooled[2] < 1
    gap = wins[0].gap_closed("planner")
    assert gap == pytest.approx([(0.4 - 0.2) / 0.3, (0.41 - 0.21) / 0.31, (0.39 - 0.19) / 0.29])
    t = d.tags()
    assert t["gate_passed"] is True and t["gate_cost_ratio"] == d.pooled[0] and t["gate_losses"] == "none"
    md = markdown(wins, ["planner"])
    assert "| a x1 | spothedge 0.4000 (100.00) | 0.1000 |" in md and "planner: gap closed" in md


def test_the_gate_refuses_a_window_below_the_slo_target_or_dearer_beyond_noise() -> None:
    d = decide([_window("a x1", [0.2, 0.21, 0.19]), _window("b x4", [0.1, 0.1, 0.1], cand_slo=0.95)], "planner")
    assert not d.passed and d.losses == ["b x4 (SLO 95.00 %)"] and "loses where it was not trained" in d.reason
    d = decide([_window("a x1", [0.2, 0.21, 0.19]), _window("b x4", [0.5, 0.52, 0.51])], "planner")
    assert not d.passed and d.losses[0].startswith("b x4 (cost x")
    d = decide([_window("a x1", [0.38, 0.43, 0.37]), _window("b x4", [0.41, 0.40, 0.41])], "planner")
    assert not d.passed and not d.losses and "beyond noise" in d.reason


def test_with_no_baseline_at_the_slo_the_best_is_the_lowest_penalized_cost() -> None:
    w = _window("a x4", [0.2, 0.2, 0.2], spothedge_slo=0.9)
    # spothedge: 0.4 + 0.02 x 100 misses = 2.4; melange 0.6 meets the SLO: it is the best baseline
    assert w.best_baseline == "melange"


# ------------------------------------------------------------------------------------------ bad input, as a user meets it
def _xroute(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "xroute_app", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, **(env or {})})


def _one_line(p: subprocess.CompletedProcess[str], needle: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_an_unknown_planner_uri_is_one_line_and_a_nonzero_exit(tmp_path: Path) -> None:
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    _one_line(_xroute("evaluate", "--capacity", "--policy", "spothedge", "--policy", "models:/xroute-planner@champion",
                      env=store), "cannot load 'models:/xroute-planner@champion'")
    _one_line(_xroute("evaluate", "--capacity", "--policy", str(tmp_path / "no-such-planner")), "unknown planner")
    (tmp_path / "empty").mkdir()
    _one_line(_xroute("evaluate", "--capacity", "--policy", str(tmp_path / "empty")), "not an exported planner")


def test_an_export_directory_is_a_policy_of_evaluate_capacity(tmp_path: Path) -> None:
    d = save_planner(random_weights(2, margin=0.1), tmp_path / "mine")
    lp = load_planner(str(d))
    assert lp.display_name == "mine" and lp.weights.knobs.margin == 0.1
    out = tmp_path / "r.json"
    p = _xroute("evaluate", "--capacity", "--policy", "spothedge", "--policy", str(d), "--seeds", "2", "--output",
                str(out), "--no-plot", "--quiet")
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())["planners"]
    assert set(rep) == {"spothedge", "mine"} and rep["mine"]["lost"] == 0 and len(rep["mine"]["per_seed"]) == 2
