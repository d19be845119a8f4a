"""The learned capacity planner's numbers: its knobs, its scorer's layers and the allocation ILP, and
their export -- numpy and SciPy only (no environment, no torch), so a registered planner loads and
plans where xroute's environment is not installed (``models.planner_pyfunc``).

The scorer (:class:`PlannerWeights`): one network shared by every pool reads the pool's row of
features and the plan's context (``models.planner_features``: :data:`POOL_FEATURES`,
:data:`CONTEXT_FEATURES` name them) and gives two numbers per pool -- ``r_p``, the probability that
a spot pool's instances are preempted within the next few epochs (a sigmoid; 0 for an on-demand
pool), and ``f_p``, a preference (the hindsight oracle's, cloned). The pool's *adjustment* is
``a_p = beta f_p - risk_price r_p - hazard_price h_p`` (``h_p``: the decision-time preemption hazard
per hour) and its effective price ``price_p x exp(-a_p) + relaunch_price x loss_p``, ``loss_p`` a spot
instance's expected preemption loss per hour (:func:`relaunch_loss_h`: ``h_p`` x its capacity covered on
demand while a replacement boots) -- additive, as a preemption's cost does not scale with the pool's price.

The allocation (:func:`allocate`): the integer instances ``x_p`` that minimize ``sum_p x_p eff_p
horizon_s + price_p launch_s_p new_p`` subject to ``sum_p cap_p x_p >= D``, ``new_p >= x_p - held_p``,
``x_p <= ub_p`` and, with ``hedge`` > 0, ``sum_{p != q} cap_p x_p >= hedge x D`` for every spot pool
``q``, and ``x_p`` at least the instances still launching there (``keep_launching``)
(``scipy.optimize.milp``, HiGHS).

The export: ``planner.json`` (format, the feature names, knobs, layer count, what training recorded)
and ``planner.npz`` (the layers ``w0, b0, w1, b1, ...``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_array

from models.policy import read_export_meta
from xroute.errors import ConfigError

FORMAT = "xroute-planner/1"
META_FILE, WEIGHTS_FILE = "planner.json", "planner.npz"
#: the scorer's inputs, in order (``models.planner_features`` computes them; a test checks the two agree)
POOL_FEATURES = ("rel_cost", "log_price", "spot", "available", "hazard", "preemptions", "recent_preemption",
                 "own_trouble", "unavailable_share", "launch", "notice", "grain")
CONTEXT_FEATURES = ("demand", "trend", "spot_open", "spot_hazard")
N_POOL, N_CONTEXT = len(POOL_FEATURES), len(CONTEXT_FEATURES)


@dataclass
class Knobs:
    """The allocator's settings (module docstring); ``models.planner_train`` searches them."""

    margin: float = 0.1
    beta: float = 1.0
    risk_price: float = 0.0
    hazard_price: float = 0.0
    relaunch_price: float = 0.0
    hedge: float = 0.0
    stabilization_s: float = 300.0
    horizon_s: float = 600.0
    cooldown: int = 2
    keep_launching: bool = True
    window_s: float = 300.0
    peak_s: float = 15.0

    def check(self) -> Knobs:
        if not isinstance(self.keep_launching, bool):
            raise ConfigError(f"planner knobs: field 'keep_launching': must be true or false, got {self.keep_launching!r}")
        for name, lo, hi in (("margin", 0.0, 10.0), ("beta", 0.0, 100.0), ("risk_price", 0.0, 1000.0),
                             ("hazard_price", 0.0, 1000.0), ("relaunch_price", 0.0, 1000.0),
                             ("hedge", 0.0, 1.0), ("stabilization_s", 0.0, 86_400.0), ("horizon_s", 1.0, 86_400.0),
                             ("cooldown", 0, 1000), ("window_s", 1.0, 86_400.0), ("peak_s", 1.0, 3600.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise ConfigError(f"planner knobs: field '{name}': must be in [{lo:g}, {hi:g}], got {v!r}")
        return self


@dataclass
class PlannerWeights:
    """The scorer's layers (``(W, b)`` pairs, ReLU between them, two outputs: the risk logit and the
    preference) and the knobs. An empty ``layers`` is the zero network: no risk, no preference."""

    layers: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    knobs: Knobs = field(default_factory=Knobs)
    meta: dict[str, Any] = field(default_factory=dict)

    def heads(self, x: np.ndarray, g: np.ndarray, spot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(``r_p``, ``f_p``) for pool rows ``x`` (P x N_POOL) in context ``g`` (N_CONTEXT); ``r_p`` is 0
        where ``spot`` is False (an on-demand instance is not preempted)."""
        P = x.shape[0]
        if not self.layers:
            return np.zeros(P), np.zeros(P)
        h = np.concatenate([x, np.broadcast_to(g, (P, g.shape[0]))], axis=1).astype(np.float64)
        for k, (w, b) in enumerate(self.layers):
            h = h @ w + b
            if k < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        risk = np.where(spot, 1.0 / (1.0 + np.exp(-np.clip(h[:, 0], -30.0, 30.0))), 0.0)
        return risk, h[:, 1]

    def adjustment(self, x: np.ndarray, g: np.ndarray, spot: np.ndarray, hazard_h: np.ndarray) -> np.ndarray:
        """``a_p = beta f_p - risk_price r_p - hazard_price h_p`` (module docstring)."""
        k = self.knobs
        r, f = self.heads(x, g, spot)
        return k.beta * f - k.risk_price * r - k.hazard_price * hazard_h  # type: ignore[no-any-return]


def allocate(cap: np.ndarray, eff_h: np.ndarray, price_h: np.ndarray, launch_s: np.ndarray, held: np.ndarray,
             ub: np.ndarray, need: float, spot: np.ndarray, hedge: float, horizon_s: float,
             time_limit: float = 5.0, lb: np.ndarray | None = None) -> np.ndarray:
    """Integer instances per candidate pool (module docstring). Shapes (n,): ``cap`` requests/s per
    instance, ``eff_h`` / ``price_h`` effective and list USD per hour, ``launch_s``, ``held``
    (launching + ready), ``ub``, ``spot`` (bool), ``lb`` the fewest to keep (default none; at most
    ``ub``). When the pools cannot cover ``need`` even at ``ub``, every pool gets its ``ub`` (the
    most that can be held)."""
    n = cap.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lb = np.zeros(n) if lb is None else np.minimum(lb, ub)
    if float(cap @ ub) < need:
        return ub.astype(np.int64)
    c = np.concatenate([eff_h * horizon_s, price_h * launch_s]) / 3600.0
    rows = [np.concatenate([cap, np.zeros(n)])]
    lo = [need]
    if hedge > 0:
        for q in np.flatnonzero(spot):
            r = np.concatenate([cap, np.zeros(n)])
            r[q] = 0.0
            rows.append(r)
            lo.append(hedge * need)
    eye = np.eye(n)
    A = np.vstack([np.array(rows), np.hstack([-eye, eye])])
    lo_all = np.concatenate([np.array(lo), -held])
    hi_all = np.full(A.shape[0], np.inf)
    if hedge > 0 and len(rows) > 1 and float(np.sort(cap * ub)[:-1].sum() if n > 1 else 0.0) < hedge * need:
        lo_all[1:len(rows)] = 0.0  # (a hedge the pools cannot give: plain coverage)
    res = milp(c, constraints=LinearConstraint(csr_array(A), lo_all, hi_all),
               integrality=np.concatenate([np.ones(n), np.zeros(n)]),
               bounds=Bounds(np.concatenate([lb, np.zeros(n)]), np.concatenate([ub, np.full(n, np.inf)])),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-4, "disp": False})
    if res.x is None:  # (not expected: feasible by construction) -- hold what is held
        return np.maximum(np.minimum(held, ub), lb).astype(np.int64)
    return np.round(res.x[:n]).astype(np.int64)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------ the export
def save_planner(weights: PlannerWeights, directory: str | Path) -> Path:
    """Write ``planner.json`` + ``planner.npz`` into ``directory`` (created); returns it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "pool_features": list(POOL_FEATURES),
            "context_features": list(CONTEXT_FEATURES), "n_layers": len(weights.layers),
            "knobs": asdict(weights.knobs), **{k: v for k, v in weights.meta.items() if k not in ("format",)}}
    (d / META_FILE).write_text(json.dumps(meta, indent=2, default=float))
    arrays: dict[str, Any] = {}
    for k, (w, b) in enumerate(weights.layers):
        arrays[f"w{k}"], arrays[f"b{k}"] = np.asarray(w, dtype=np.float64), np.asarray(b, dtype=np.float64)
    np.savez(d / WEIGHTS_FILE, **arrays)
    return d


def read_planner(directory: str | Path) -> PlannerWeights:
    """The weights under ``directory`` (or the one directory below it holding ``planner.json``,
    e.g. a downloaded MLflow model). A bad export is a ConfigError naming the file and field."""
    d, meta = read_export_meta(directory, META_FILE, FORMAT, "planner")
    if meta.get("pool_features") != list(POOL_FEATURES) or meta.get("context_features") != list(CONTEXT_FEATURES):
        raise ConfigError(f"{d / META_FILE}: field 'pool_features': the planner was trained on another feature layout "
                          "than models.planner_features defines now; retrain it (xroute train-planner)")
    try:
        knobs = Knobs(**meta.get("knobs", {})).check()
    except TypeError as e:
        raise ConfigError(f"{d / META_FILE}: field 'knobs': {e}") from None
    n_layers = int(meta.get("n_layers", 0))
    layers = []
    if n_layers:
        if not (d / WEIGHTS_FILE).is_file():
            raise ConfigError(f"{d}: {WEIGHTS_FILE} is missing")
        with np.load(d / WEIGHTS_FILE) as z:
            try:
                layers = [(z[f"w{k}"], z[f"b{k}"]) for k in range(n_layers)]
            except KeyError as e:
                raise ConfigError(f"{d / WEIGHTS_FILE}: layer {e} is missing") from None
        width = N_POOL + N_CONTEXT
        if layers[0][0].shape[0] != width or layers[-1][0].shape[1] != 2:
            raise ConfigError(f"{d / WEIGHTS_FILE}: the layers take {layers[0][0].shape[0]} inputs and give "
                              f"{layers[-1][0].shape[1]} outputs; expected {width} and 2")
    rest = {k: v for k, v in meta.items() if k not in ("pool_features", "context_features", "n_layers", "knobs")}
    return PlannerWeights(layers, knobs, rest)


def relaunch_loss_h(hazard_h: np.ndarray, price_h: np.ndarray, cap: np.ndarray, launch_s: np.ndarray,
                    spot: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """A spot instance's expected preemption loss, USD per hour held: its hazard (preemptions per hour)
    x what one preemption costs -- the instance's capacity covered at the fallback price while its
    replacement boots, ``cap_p x launch_s_p / 3600 x`` the cheapest eligible on-demand USD per hour per
    request/s (the cheapest eligible pool's when no on-demand pool is). What a preemption costs does
    not scale with the preempted pool's own price: a multiplicative penalty (``hazard_price``) makes a
    cheap pool with a high recorded hazard as dear as a safe one many times its price. 0 on demand."""
    per_cap = np.where(cap > 0, price_h / np.where(cap > 0, cap, 1.0), np.inf)
    ok = eligible & (cap > 0) & np.isfinite(per_cap)
    od = ok & ~spot
    ref = per_cap[od].min() if od.any() else (per_cap[ok].min() if ok.any() else 0.0)
    return np.where(spot, hazard_h * cap * launch_s / 3600.0 * ref, 0.0)  # type: ignore[no-any-return]


def plan_targets(weights: PlannerWeights, x: np.ndarray, g: np.ndarray, spot: np.ndarray, hazard_h: np.ndarray,
                 price_h: np.ndarray, cap: np.ndarray, launch_s: np.ndarray, held: np.ndarray, ub: np.ndarray,
                 eligible: np.ndarray, demand: float, launching: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One plan over P pools (what ``models.planner_policy.LearnedPlanner`` and the registered model
    compute): the adjustments ``a_p`` and the targets -- :func:`allocate` over the eligible pools for
    ``demand x (1 + margin)`` requests/s at the effective prices, 0 elsewhere; with ``keep_launching``,
    an eligible pool keeps the instances still ``launching`` there (their boot is paid: cancelling
    one to launch another is the churn a re-solved mix otherwise makes). ``demand``: the forecast,
    held at its highest of the last ``stabilization_s`` seconds by the caller."""
    k = weights.knobs
    adj = weights.adjustment(x, g, spot, hazard_h)
    out = np.zeros(x.shape[0], dtype=np.int64)
    pools = np.flatnonzero(eligible)
    need = demand * (1.0 + k.margin)
    if pools.size and need > 0:
        price = price_h[pools]
        eff = price * np.exp(-np.clip(adj[pools], -20.0, 20.0))
        if k.relaunch_price > 0:
            eff = eff + k.relaunch_price * relaunch_loss_h(hazard_h, price_h, cap, launch_s, spot, eligible)[pools]
        keep = launching[pools].astype(float) if k.keep_launching and launching is not None else None
        out[pools] = allocate(cap[pools], eff, price, launch_s[pools], held[pools].astype(float),
                              ub[pools].astype(float), need, spot[pools], k.hedge, k.horizon_s, lb=keep)
    return adj, out
