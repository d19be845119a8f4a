"""Decision-time features of the learned capacity planner (``models.planner_policy``).

Every epoch the planner turns what it knows -- the world's :class:`~envs.provisioning.PlanContext`
and :class:`~envs.provisioning.PlanView`, and its own memory of the views it was given before
(:class:`PlannerMemory`) -- into

* the **demand** (:func:`demand`): per request class the busiest ``peak_s`` window's arrival rate
  over the last ``window_s`` seconds (``models.planners.forecast``: the past only), its class mix,
  and each pool's capacity for that mix (``models.planners.capacity_table``, one instance,
  requests/s at the classes' SLOs);
* which pools may take a **new** instance (:func:`eligible`): priced, able to serve the mix, and,
  for a spot pool, recorded available now with no notice and no failed launch of its own
  instances in the last ``cooldown`` epochs;
* one row of :data:`POOL_FEATURES` per pool and the :data:`CONTEXT_FEATURES` of the whole plan
  (:func:`features`), what the shared per-pool scorer reads.

Nothing here reads the future: the telemetry is the view's (recorded at or before the epoch's
start), the load the arrivals before it, the memory the earlier views (``tests/test_no_foresight.py``
checks the learned planner as it checks every baseline). The holdings a policy chose are *not*
features: the scorer rates pools, the allocator (``models.planner_policy.allocate``) weighs what
is held against what a launch costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from envs.provisioning import PlanContext, PlanView
from models import planner_net
from models.planners import ClassProfile, capacity_table, class_profile, mix_capacity, peak_rate

#: per-pool features: (name, meaning); every value is scaled to roughly [-2, 2] (the names and their order:
#: ``models.planner_net.POOL_FEATURES``, what an export records)
POOL_FEATURES: tuple[tuple[str, str], ...] = (
    ("rel_cost", "ln(price per unit of capacity / the cheapest eligible pool's), clipped to [0, 5]"),
    ("log_price", "ln(an instance's USD per hour) / 4, clipped to [-2, 2]"),
    ("spot", "1 for a spot pool"),
    ("available", "the trace records it available now"),
    ("hazard", "preemptions per hour (the decision-time posterior mean) / 4, at most 2"),
    ("preemptions", "ln(1 + preemptions recorded in the lookback) / 3"),
    ("recent_preemption", "exp(-hours since the last recorded preemption); 0 when none is recorded"),
    ("own_trouble", "exp(-epochs since one of its own launches failed or instances got a notice / 5); 0: never"),
    ("unavailable_share", "share of the window's epochs so far the trace recorded it unavailable"),
    ("launch", "launch delay / 600 s"),
    ("notice", "the cloud's preemption notice / 120 s"),
    ("grain", "ln(one instance's capacity / the demand) / 3, clipped to [-2, 1]"),
)
#: the plan's context, fed to every pool's row
CONTEXT_FEATURES: tuple[tuple[str, str], ...] = (
    ("demand", "ln(1 + forecast requests/s) / 4"),
    ("trend", "requests/s of the last epoch over those of the forecast window, at most 3"),
    ("spot_open", "share of the spot pools eligible now"),
    ("spot_hazard", "mean hazard (per hour / 4) of the eligible spot pools"),
)
N_POOL, N_CONTEXT = len(POOL_FEATURES), len(CONTEXT_FEATURES)
if tuple(n for n, _ in POOL_FEATURES) != planner_net.POOL_FEATURES or \
        tuple(n for n, _ in CONTEXT_FEATURES) != planner_net.CONTEXT_FEATURES:  # pragma: no cover
    raise ImportError("models.planner_features and models.planner_net name different features")


@dataclass
class PlannerMemory:
    """What the planner keeps from the views it was given before (per pool): epochs since its own
    instances last failed to launch or got a notice, epochs the trace recorded it unavailable,
    epochs seen, and the demands it planned for (the stabilization window)."""

    trouble_age: np.ndarray
    unavailable: np.ndarray
    epochs: int = 0
    demands: list[tuple[float, float]] = field(default_factory=list)

    @classmethod
    def new(cls, n_pools: int) -> PlannerMemory:
        return cls(trouble_age=np.full(n_pools, np.inf), unavailable=np.zeros(n_pools))

    def observe(self, view: PlanView) -> None:
        """Fold in the view of a new epoch (before planning it)."""
        bad = (view.failed_launches > 0) | (view.noticed_last > 0) | (view.noticed > 0)
        self.trouble_age = np.where(bad, 0.0, self.trouble_age + 1.0)
        self.unavailable += ~view.available
        self.epochs += 1


@dataclass
class Demand:
    """The load a plan covers: ``rate`` per class (requests/s, the forecast), ``total``, the class
    ``share``, and per pool ``mix_cap`` (requests/s of that mix one instance serves at the SLOs,
    0 where it cannot) and ``per_cap`` (USD per hour per unit of it, inf where none)."""

    rate: np.ndarray
    total: float
    share: np.ndarray
    mix_cap: np.ndarray
    per_cap: np.ndarray
    profile: ClassProfile


def demand(ctx: PlanContext, view: PlanView, headroom: float, window_s: float, peak_s: float,
           fallback_share: np.ndarray) -> Demand:
    """The forecast (the past only) and each pool's capacity for its class mix (module docstring)."""
    t = np.concatenate([ctx.hist_t, view.arr_t])
    c = np.concatenate([ctx.hist_class, view.arr_class])
    C = len(ctx.class_names)
    rate = peak_rate(t, c, C, view.t - window_s, view.t, peak_s)
    total = float(rate.sum())
    share = rate / total if total > 0 else fallback_share
    prof = class_profile(ctx, view)
    cap, _ = capacity_table(ctx, prof, headroom)
    mix = mix_capacity(cap, share)
    price = view.price_h
    with np.errstate(divide="ignore", invalid="ignore"):
        per_cap = np.where((mix > 0) & np.isfinite(price), price / np.where(mix > 0, mix, 1.0), np.inf)
    return Demand(rate, total, share, mix, per_cap, prof)


def eligible(ctx: PlanContext, view: PlanView, mem: PlannerMemory, dem: Demand, cooldown: int) -> np.ndarray:
    """Pools that may hold instances in the plan (module docstring)."""
    ok = np.isfinite(dem.per_cap)
    spot_ok = view.available & (view.noticed == 0) & (mem.trouble_age >= cooldown)
    return ok & (~ctx.pools.is_spot | spot_ok)  # type: ignore[no-any-return]


def features(ctx: PlanContext, view: PlanView, mem: PlannerMemory, dem: Demand, elig: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """(P x :data:`N_POOL` pool rows, :data:`N_CONTEXT` context) as float32 (module docstring)."""
    pl = ctx.pools
    P = pl.n
    x = np.zeros((P, N_POOL), dtype=np.float32)
    best = float(np.min(dem.per_cap[elig])) if elig.any() else 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.log(np.where(np.isfinite(dem.per_cap), dem.per_cap, best * math.e ** 5) / best)
    x[:, 0] = np.clip(rel, 0.0, 5.0)
    x[:, 1] = np.clip(np.log(np.maximum(np.nan_to_num(view.price_h, nan=1e-3), 1e-3)) / 4.0, -2.0, 2.0)
    x[:, 2] = pl.is_spot
    x[:, 3] = view.available
    x[:, 4] = np.clip(view.hazard * 3600.0 / 4.0, 0.0, 2.0)
    x[:, 5] = np.log1p(view.preemptions) / 3.0
    x[:, 6] = np.exp(-np.minimum(view.since_preempt_s, 1e9) / 3600.0)
    x[:, 7] = np.exp(-mem.trouble_age / 5.0)
    x[:, 8] = mem.unavailable / max(mem.epochs, 1)
    x[:, 9] = pl.launch_s / 600.0
    x[:, 10] = pl.notice_s / 120.0
    d = max(dem.total, 1e-3)
    with np.errstate(divide="ignore"):
        x[:, 11] = np.clip(np.log(np.maximum(dem.mix_cap, 1e-9) / d) / 3.0, -2.0, 1.0)
    g = np.zeros(N_CONTEXT, dtype=np.float32)
    g[0] = math.log1p(dem.total) / 4.0
    t = np.concatenate([ctx.hist_t, view.arr_t])
    last = float(np.sum((t >= view.t - ctx.epoch_s) & (t < view.t))) / ctx.epoch_s
    window = 300.0
    mean = float(np.sum((t >= view.t - window) & (t < view.t))) / window
    g[1] = min(last / mean, 3.0) if mean > 0 else 1.0
    spot = pl.is_spot
    g[2] = float((elig & spot).sum()) / max(int(spot.sum()), 1)
    hz = view.hazard[elig & spot]
    g[3] = float(np.clip(hz.mean() * 3600.0 / 4.0, 0.0, 2.0)) if hz.size else 0.0
    return x, g
