"""The learned capacity planner: a shared per-pool scorer and a budgeted allocation (inference only:
numpy and SciPy, no torch -- ``models.planner_train`` trains it).

Every epoch, from decision-time information alone (``models.planner_features``):

1. **the demand** ``D``: the forecast requests/s (the busiest 15-s window of the last 300 s),
   held at the highest of the last ``stabilization_s`` seconds (HPA's scale-down stabilization), times
   ``1 + margin``; each pool's capacity ``cap_p`` for the class mix (requests/s one instance serves at
   the SLOs, ``models.planners.capacity_table``);
2. **the scores**: one network shared by every pool (so it scales to any number of pools) reads the
   pool's row of :data:`~models.planner_features.POOL_FEATURES` and the plan's
   :data:`~models.planner_features.CONTEXT_FEATURES` and gives two numbers per pool: ``r_p``, the
   probability that a spot pool's instances are preempted within the next few epochs (a sigmoid;
   0 for an on-demand pool), and ``f_p``, a preference (the hindsight oracle's, cloned). The pool's
   *adjustment* is ``a_p = beta f_p - risk_price r_p - hazard_price h_p`` (``h_p``: the decision-time
   preemption hazard per hour) and its **effective price** ``price_p x exp(-a_p)`` -- a pool the scorer
   trusts costs less than its list price, one it distrusts more -- plus ``relaunch_price x loss_p``, a
   spot instance's expected preemption loss per hour (``models.planner_net.relaunch_loss_h``: ``h_p`` x
   its capacity covered on demand while a replacement boots; it does not grow with the pool's price);
3. **the allocation** (:func:`allocate`): the integer instances ``x_p`` that minimize
   ``sum_p x_p eff_p horizon_s + price_p launch_s_p new_p`` (a new instance pays its boot; what is
   held does not) subject to ``sum_p cap_p x_p >= D``, ``new_p >= x_p - held_p``, ``x_p`` within the
   quotas and ``max_instances_per_pool``, ``x_p = 0`` where a pool is not eligible (a spot pool recorded
   out, noticed, or where one of its launches failed in the last ``cooldown`` epochs) and, with
   ``hedge`` > 0, ``sum_{p != q} cap_p x_p >= hedge x D`` for every spot pool ``q`` (losing any one spot
   pool leaves that share), and ``x_p`` at least the instances still launching in an eligible pool
   (``keep_launching``: their boot is paid) -- an ILP (``scipy.optimize.milp``, HiGHS), a few ms at
   100 pools.

With a zero network this is a Mélange-style mix over the spot and on-demand pools priced by the
decision-time preemption hazard; training (``models.planner_train``) learns the two heads -- the risk
from the real spot traces, the preference by cloning the oracle's plans -- and then searches the
knobs on rollouts (a cost-sensitive fine-tune).

The numbers -- the knobs, the scorer, the ILP and the export -- are ``models.planner_net``'s.
:func:`load_planner` reads an export from a directory,
``models:/NAME@ALIAS`` or ``runs:/...`` (``xroute evaluate --capacity --policy
models:/xroute-planner@champion``); :func:`resolve_planner` is what the evaluation calls for any
``--policy`` it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.provisioning import PlanContext, PlanView
from models.planner_features import Demand, PlannerMemory, demand, eligible, features
from models.planner_net import PlannerWeights, plan_targets, read_planner
from models.planners import PLANNERS, _Base, make_planner
from xroute.config import PlannersConfig
from xroute.errors import ConfigError

#: the name ``--policy`` gives a learned planner in reports when it has none of its own
DEFAULT_NAME = "learned"


@dataclass
class PlanStep:
    """One epoch's decision, for training and explanations: the pool rows, the context, the
    eligible pools, the demand (the forecast's, ``held_demand`` its highest over the stabilization
    window, ``need`` that plus the margin: what the plan covers), the adjustments and the targets."""

    x: np.ndarray
    g: np.ndarray
    eligible: np.ndarray
    demand: Demand
    held_demand: float
    need: float
    scores: np.ndarray
    targets: np.ndarray


class LearnedPlanner(_Base):
    """The learned planner (module docstring) with ``weights``."""

    name = DEFAULT_NAME
    display_name = DEFAULT_NAME

    def __init__(self, cfg: PlannersConfig | None = None, weights: PlannerWeights | None = None,
                 name: str | None = None):
        super().__init__(cfg)
        self.weights = weights if weights is not None else PlannerWeights()
        self.weights.knobs.check()
        if name:
            self.display_name = name
        self.last: PlanStep | None = None

    def reset(self, ctx: PlanContext) -> None:
        super().reset(ctx)
        self.mem = PlannerMemory.new(ctx.pools.n)

    def plan(self, view: PlanView) -> np.ndarray:
        return self.step(view).targets

    def step(self, view: PlanView) -> PlanStep:
        ctx, k = self.ctx, self.weights.knobs
        pl = ctx.pools
        self.mem.observe(view)
        dem = demand(ctx, view, self.cfg.headroom, k.window_s, k.peak_s, self.share)
        mem = self.mem
        mem.demands.append((view.t, dem.total))
        mem.demands = [(t, d) for t, d in mem.demands if t > view.t - k.stabilization_s - 1e-9] or [(view.t, dem.total)]
        held_demand = max(d for _, d in mem.demands)
        elig = eligible(ctx, view, mem, dem, k.cooldown)
        x, g = features(ctx, view, mem, dem, elig)
        held = view.held
        ub = np.minimum(held + np.maximum(view.quota_room, 0), ctx.max_instances)
        adj, out = plan_targets(self.weights, x, g, pl.is_spot, view.hazard * 3600.0, view.price_h, dem.mix_cap,
                                pl.launch_s, held, ub, elig, held_demand, view.launching)
        self.last = PlanStep(x, g, elig, dem, held_demand, held_demand * (1.0 + k.margin), adj, out)
        return self.last


def load_planner(uri: str, cfg: PlannersConfig | None = None) -> LearnedPlanner:
    """A learned planner from an export directory, ``models:/NAME@ALIAS`` (or ``/VERSION``) or
    ``runs:/RUN_ID/PATH`` (the default MLflow store unless ``$MLFLOW_TRACKING_URI``)."""
    if uri.startswith(("models:/", "runs:/")):
        from models.loader import download_model

        return LearnedPlanner(cfg, read_planner(download_model(uri)), name=uri)
    p = Path(uri)
    if not p.exists():
        raise ConfigError(f"--policy: unknown planner '{uri}' (planners: {', '.join(PLANNERS)}, a models:/ or runs:/ "
                          "URI of a learned planner, or its export directory)")
    return LearnedPlanner(cfg, read_planner(p), name=p.name or uri)


def resolve_planner(name: str, cfg: PlannersConfig | None = None) -> Any:
    """A baseline by name (``models.planners.make_planner``), else a learned planner (:func:`load_planner`)."""
    return planner_factory(name, cfg)()


def planner_factory(name: str, cfg: PlannersConfig | None = None) -> Callable[[], Any]:
    """A function that makes a fresh planner ``name`` (a new one per run): a baseline, or a learned
    planner whose export is read (or downloaded) once, here -- so an unknown name fails at once."""
    if name in PLANNERS:
        make_planner(name, cfg)
        return lambda: make_planner(name, cfg)
    lp = load_planner(name, cfg)
    weights, display = lp.weights, lp.display_name
    return lambda: LearnedPlanner(cfg, weights, name=display)
