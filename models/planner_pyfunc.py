"""The learned capacity planner as an MLflow ``pyfunc`` model (what the registry holds as
``xroute-planner``, beside the router's ``xroute-router``).

Input: a DataFrame, one row per plan (P pools, any P):

=================  =================  =========================================================
column             type               meaning
=================  =================  =========================================================
``plan_id``        string (optional)  echoed back
``pools``          array of double    the pools' feature rows, flattened row-major
                                      (``P * len(models.planner_net.POOL_FEATURES)``)
``context``        array of double    the plan's ``models.planner_net.CONTEXT_FEATURES``
``spot``           array of double    1 = a spot pool
``hazard_h``       array of double    decision-time preemption hazard, per hour
``price_h``        array of double    an instance's USD per hour
``capacity``       array of double    requests/s one instance serves at the SLOs (0: none)
``launch_s``       array of double    launch delay, seconds
``held``           array of double    instances launching or ready
``launching``      array of double    of which launching
``max_instances``  array of double    the most the pool may hold (quota, cap)
``eligible``       array of double    1 = may hold instances in this plan
``demand``         double             requests/s to cover (the forecast held over the
                                      stabilization window; the model adds its margin)
=================  =================  =========================================================

Output: ``plan_id`` (when given), ``targets`` (instances per pool), ``risk`` (each pool's
predicted preemption probability) and ``adjustment`` (``a_p``: effective price = price x
exp(-a_p)) -- ``models.planner_net.plan_targets``, what ``xroute evaluate --capacity`` plays.
Numpy and SciPy only; the model carries :data:`INFERENCE_MODULES` (``models.pyfunc.stage_code``)
and loads without xroute installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel
from mlflow.types import ColSpec, Schema
from mlflow.types.schema import Array

from models.planner_net import N_CONTEXT, N_POOL, PlannerWeights, plan_targets, read_planner

ARTIFACT_KEY = "planner"
#: every module of ours that loading and planning imports
INFERENCE_MODULES = ("models.planner_pyfunc", "models.planner_net", "xroute.errors")
REQUIREMENTS = ("numpy", "scipy", "pandas")
MODEL_CODE = Path(__file__).with_name("planner_pyfunc_model.py")
ARRAYS = ("spot", "hazard_h", "price_h", "capacity", "launch_s", "held", "launching", "max_instances", "eligible")


def predict_frame(weights: PlannerWeights, model_input: pd.DataFrame) -> pd.DataFrame:
    """Plan every row of ``model_input`` with ``weights`` (module docstring)."""
    missing = [c for c in ("pools", "context", *ARRAYS, "demand") if c not in model_input.columns]
    if missing:
        raise ValueError(f"input is missing column(s) {', '.join(missing)}")
    out: dict[str, list[Any]] = {"targets": [], "risk": [], "adjustment": []}
    for k, row in enumerate(model_input.itertuples(index=False)):
        cols = {c: np.asarray(getattr(row, c), dtype=float) for c in ARRAYS}
        P = cols["spot"].size
        x = np.asarray(row.pools, dtype=float)
        g = np.asarray(row.context, dtype=float)
        if x.size != P * N_POOL or g.size != N_CONTEXT or any(v.size != P for v in cols.values()):
            raise ValueError(f"row {k}: 'pools' has {x.size} values, 'context' {g.size} and 'spot' {P}; expected "
                             f"{N_POOL} per pool, {N_CONTEXT} context values and one value per pool in {', '.join(ARRAYS)}")
        spot = cols["spot"] > 0.5
        x = x.reshape(P, N_POOL)
        adj, tg = plan_targets(weights, x, g, spot, cols["hazard_h"], cols["price_h"], cols["capacity"],
                               cols["launch_s"], cols["held"], cols["max_instances"], cols["eligible"] > 0.5,
                               float(row.demand), cols["launching"])
        risk, _ = weights.heads(x, g, spot)
        out["targets"].append(tg.tolist())
        out["risk"].append(risk.tolist())
        out["adjustment"].append(adj.tolist())
    df = pd.DataFrame(out)
    if "plan_id" in model_input.columns:
        df.insert(0, "plan_id", model_input["plan_id"].astype(str).to_numpy())
    return df


class PlannerModel(PythonModel):
    """``mlflow.pyfunc`` wrapper of an exported planner (artifact ``planner``: the export directory)."""

    def load_context(self, context: Any) -> None:
        self.weights = read_planner(context.artifacts[ARTIFACT_KEY])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return predict_frame(self.weights, model_input)


def signature() -> ModelSignature:
    vec = Array("double")
    return ModelSignature(
        inputs=Schema([ColSpec("string", "plan_id", required=False), ColSpec(vec, "pools"), ColSpec(vec, "context"),
                       *[ColSpec(vec, c) for c in ARRAYS], ColSpec("double", "demand")]),
        outputs=Schema([ColSpec("string", "plan_id", required=False), ColSpec(Array("long"), "targets"),
                        ColSpec(vec, "risk"), ColSpec(vec, "adjustment")]))


def example_row(step: Any, view: Any, pools: Any, max_instances: int, plan_id: str = "example") -> dict[str, Any]:
    """The model input of one plan of ``models.planner_policy.LearnedPlanner`` (its ``last`` step,
    the view it planned from, the world's pools): what an example and a test feed the model."""
    held = np.asarray(view.held, dtype=float)
    ub = np.minimum(held + np.maximum(view.quota_room, 0), max_instances)
    d = step.held_demand
    return {"plan_id": plan_id, "pools": np.asarray(step.x, dtype=float).ravel(), "context": np.asarray(step.g, dtype=float),
            "spot": pools.is_spot.astype(float), "hazard_h": view.hazard * 3600.0,
            "price_h": np.nan_to_num(view.price_h, nan=0.0), "capacity": step.demand.mix_cap, "launch_s": pools.launch_s,
            "held": held, "launching": np.asarray(view.launching, dtype=float), "max_instances": ub.astype(float), "eligible": step.eligible.astype(float), "demand": d}
