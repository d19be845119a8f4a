"""The capacity planners (``models.planners``) on toy traces: SpotHedge's published rules -- its
on-demand fallback sized to the spot shortfall, its spread over active locations, a preempted
location avoided, the hysteresis of its target --, HPA's rule and stabilization window, the
Mélange-style ILP against brute force, the oracle planning launches ahead of a surge it foresees."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from envs.provisioning import PlanView, ProvisionWorld
from models.planners import ReactiveAutoscaler, SpotHedge, make_planner, solve_mix
from tests.capbundle import OD, SPOT, SPOT_AZ, SPOT_W, T0, write_capbundle
from xroute.config import PlannersConfig
from xroute.errors import ConfigError


def _history(n: int, span_s: float = 60.0) -> pd.DataFrame:
    """``n`` requests evenly over the ``span_s`` seconds before T0 (3 a second for 180 over 60 s)."""
    ts = [T0 - pd.Timedelta(seconds=span_s) + pd.Timedelta(seconds=span_s * (k + 0.5) / n) for k in range(n)]
    return pd.DataFrame({"ts": ts, "request_id": [f"h{k}" for k in range(n)], "origin": "aws:us-east-1",
                         "input_tokens": 1000, "output_tokens": 100, "tenant": "a"})


@pytest.fixture
def toy(tmp_path: Path) -> ProvisionWorld:
    root = write_capbundle(tmp_path, [{"t": k * 20.0} for k in range(60)])
    return ProvisionWorld(str(root), {"serving_config": str((root / "serving.yaml").resolve()), "spot_lag_s": 0.0},
                          history=_history(180))


def _idx(w: ProvisionWorld, oid: str) -> int:
    return w.pool_index[f"llama-2-7b@{oid}"]


def _with(view: PlanView, w: ProvisionWorld, **per_pool: dict[str, int]) -> PlanView:
    """``view`` with some per-pool counts replaced, e.g. ``ready={SPOT: 2}``."""
    upd = {}
    for field, values in per_pool.items():
        a = np.zeros_like(getattr(view, field))
        for oid, v in values.items():
            a[_idx(w, oid)] = v
        upd[field] = a
    return dataclasses.replace(view, **upd)


def test_spothedge_fallback_is_sized_to_the_spot_shortfall(toy: ProvisionWorld) -> None:
    """N_tar = ceil(3 qps / 1 qps per replica) = 3; spot target N_tar + 1 overprovisioned = 4, spread
    over the three active locations (fewest first); on-demand = max(0, 4 - ready spot), at most N_tar."""
    w = toy
    cfg = PlannersConfig.model_validate({"spothedge": {"target_qps_per_replica": 1.0, "num_overprovision": 1}})
    sh = SpotHedge(cfg)
    sh.reset(w.reset(seed=0))
    v0 = w.view()
    out = sh.plan(v0)
    assert [out[_idx(w, o)] for o in (SPOT, SPOT_W, SPOT_AZ)] == [2, 1, 1]
    assert out[_idx(w, OD)] == 3  # nothing ready: min(4 - 0, N_tar = 3)
    for ready_spot, od in ((1, 3), (2, 2), (3, 1), (4, 0), (5, 0)):
        split = {SPOT: min(ready_spot, 2), SPOT_W: max(0, min(ready_spot - 2, 1)), SPOT_AZ: max(0, ready_spot - 3)}
        v = _with(v0, w, ready=split)
        assert sh.plan(v)[_idx(w, OD)] == od, ready_spot


def test_spothedge_avoids_a_preempted_location_until_too_few_are_left(toy: ProvisionWorld) -> None:
    w = toy
    cfg = PlannersConfig.model_validate({"spothedge": {"target_qps_per_replica": 1.0, "num_overprovision": 1}})
    sh = SpotHedge(cfg)
    sh.reset(w.reset(seed=0))
    v0 = w.view()
    sh.plan(v0)
    # SPOT's replica was just preempted, one is ready at each other location: the two missing go there, not to SPOT
    v = _with(v0, w, ready={SPOT_W: 1, SPOT_AZ: 1}, noticed_last={SPOT: 1})
    out = sh.plan(v)
    assert out[_idx(w, SPOT)] == 0 and out[_idx(w, SPOT_W)] == 2 and out[_idx(w, SPOT_AZ)] == 2
    assert out[_idx(w, OD)] == 2  # the shortfall: 4 wanted, 2 ready
    # a launch fails at SPOT_W too: one active location left, so every location is active again
    v = _with(v0, w, ready={SPOT_AZ: 1}, failed_launches={SPOT_W: 1})
    out = sh.plan(v)
    assert out[_idx(w, SPOT)] >= 1 and out[[_idx(w, o) for o in (SPOT, SPOT_W, SPOT_AZ)]].sum() == 4


def test_spothedge_target_hysteresis(toy: ProvisionWorld) -> None:
    """SkyServe's defaults at one decision a minute: a higher target after 300 s of higher ones (5
    decisions), a lower one after 1200 s (20)."""
    w = toy
    cfg = PlannersConfig.model_validate({"spothedge": {"target_qps_per_replica": 1.0, "num_overprovision": 0}})
    sh = SpotHedge(cfg)
    sh.reset(w.reset(seed=0))
    v0 = w.view()
    sh.plan(v0)
    assert sh._n_tar == 3

    def at(k: int, qps: float) -> PlanView:
        t = v0.t + 60.0 * k
        n = int(qps * 60)
        arr = t - 60.0 + (np.arange(n) + 0.5) * 60.0 / n
        return dataclasses.replace(v0, t=t, epoch=k, arr_t=arr, arr_class=np.zeros(n, dtype=np.int64),
                                   arr_in=np.full(n, 1000.0), arr_origin=np.zeros(n, dtype=np.int64))

    def n_tar(v: PlanView) -> int:
        sh.plan(v)
        return int(sh._n_tar or 0)

    targets = [n_tar(at(k, 5.0)) for k in range(1, 7)]
    assert targets == [3, 3, 3, 3, 5, 5]
    targets = [n_tar(at(k, 1.0)) for k in range(7, 28)]
    assert targets[:19] == [5] * 19 and targets[19] == 1


def test_autoscaler_hpa_rule_and_scale_down_window(toy: ProvisionWorld) -> None:
    """HPA: desired = ceil(ready x observed / target) -- target 0.7 x the SLO-feasible concurrency (2
    slots), observed the requests in flight per replica -- at once upward, downward only to the
    highest recommendation of the last 300 s; no metric yet (nothing ready): no change."""
    w = toy
    a = ReactiveAutoscaler(PlannersConfig())
    a.reset(w.reset(seed=0))
    v0 = w.view()
    p = _idx(w, OD)
    n0 = int(a.plan(v0)[p])  # starts where static peak provisioning would
    assert n0 >= 1

    def at(k: int, ready: int, in_flight_per_replica: float) -> PlanView:
        work = np.zeros(w.P)
        work[p] = in_flight_per_replica * ready * 60.0
        return dataclasses.replace(_with(v0, w, ready={OD: ready}), t=v0.t + 60.0 * k, epoch=k, work_s=work)

    assert a.plan(at(1, n0, 2.8))[p] == 2 * n0  # ratio 2.8 / 1.4 = 2: double, at once
    assert a.plan(at(2, 2 * n0, 1.45))[p] == 2 * n0  # within the 10 % tolerance
    downs = [a.plan(at(k, 2 * n0, 0.35))[p] for k in range(3, 10)]  # desired a quarter, held by the 5-minute window
    assert downs[:4] == [2 * n0] * 4 and downs[-1] == math.ceil(2 * n0 / 4)


def test_the_ilp_finds_the_cheapest_mix() -> None:
    """``solve_mix`` against brute force over every integer mix (each checked feasible by an LP of
    the classes' shares): three pools, two classes with different capacity per pool."""
    from scipy.optimize import linprog

    cap = np.array([[[2.0, 0.0], [1.0, 1.0], [0.5, 3.0]]])
    rate = np.array([[5.0, 4.0]])
    price = np.array([[1.0, 0.9, 1.6]])
    x = solve_mix(cap, rate, price, np.zeros(3), np.zeros(3), np.full(3, 8.0), 3600.0, False, None, 10.0, 0.0)[0]
    # shares y = (y00, y01, y10, y11, y20, y21): cap . y >= rate per class, y_p0 + y_p1 <= x_p per pool
    A = [[-2.0, 0, -1.0, 0, -0.5, 0], [0, 0.0, 0, -1.0, 0, -3.0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0],
         [0, 0, 0, 0, 1, 1]]
    best = min(float(np.dot(price[0], xs)) for xs in itertools.product(range(9), repeat=3)
               if linprog(np.zeros(6), A_ub=A, b_ub=[-5.0, -4.0, *xs], bounds=(0, None)).status == 0)
    assert float(np.dot(price[0], x)) == pytest.approx(best)


def test_the_oracle_launches_ahead_of_a_surge_it_foresees(tmp_path: Path) -> None:
    """A surge of requests from T0 + 600 s: the oracle's plan adds instances at least the launch
    delay (120 s, two epochs) before it; a planner of the past cannot."""
    reqs = [{"t": k * 10.0} for k in range(60)] + [{"t": 600 + k * 0.1, "out": 300} for k in range(3000)]
    root = write_capbundle(tmp_path, reqs)
    w = ProvisionWorld(str(root), {"serving_config": str((root / "serving.yaml").resolve()), "spot_lag_s": 0.0},
                       history=_history(60, 600.0))
    o = make_planner("oracle")
    o.bind(w)
    o.reset(w.reset(seed=0))
    plan = o._plan.sum(axis=1)
    assert plan[8] > plan[5]  # instances launching at 480 s for 600 s
    assert o.planned_x[10].sum() > o.planned_x[5].sum()


def test_planners_refuse_a_window_without_history(tmp_path: Path) -> None:
    root = write_capbundle(tmp_path, [{"t": 0}, {"t": 100}])
    w = ProvisionWorld(str(root), {"serving_config": str((root / "serving.yaml").resolve())})
    with pytest.raises(ConfigError, match="history"):
        make_planner("static-ondemand").reset(w.reset(seed=0))
    with pytest.raises(ConfigError, match="unknown planner 'greedy'"):
        make_planner("greedy")
