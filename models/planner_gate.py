"""The planner's promotion gate: does a learned capacity planner beat the best baseline on windows no
training or selection saw?

``xroute train-planner`` plays the candidate planners (the challenger and its ablation) beside every
baseline (``static-ondemand``, ``autoscaler``, ``spothedge``, ``melange``) and the hindsight oracle on
each gate window -- the test windows of the gate bundles at each gate load -- for several seeds,
paired by seed (``models.capacity_eval``: the same service-time noise and preemption instants for
every planner). Per window the comparator is the **best baseline**: the cheapest (mean held cost)
of those meeting the SLO target (>= 99 % attainment), or, where none does, the one with the lowest
penalized cost. The gate passes when

* the **pooled** paired cost ratio -- per seed, the mean over the windows of the candidate's held
  cost over the best baseline's; a 95 % t-interval over the seeds -- has its upper bound below 1, and
* **no window** is lost: the candidate meets the SLO target there (mean over the seeds) and its cost
  ratio's interval is not entirely above 1.

Reported beside it per window (:func:`markdown`): the ratio to SpotHedge and the share of the best
baseline -> oracle gap the candidate closes, each with its interval. ``xroute promote --model
xroute-planner`` reads the verdict from the registered version's tags (``models.registry.promote``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.capacity_eval import SLO_TARGET, PlannerResult, evaluate_capacity
from models.evaluate import t_interval
from models.planner_net import PlannerWeights
from models.planner_policy import LearnedPlanner
from models.scenarios import Scenario
from xroute.config import CapacityConfig

BASELINES = ("static-ondemand", "autoscaler", "spothedge", "melange")
ORACLE = "oracle (hindsight)"


def penalized_cost(m: dict[str, Any], miss_usd: float) -> float:
    """Held cost plus ``miss_usd`` per request that missed its SLO (USD)."""
    return float(m["cost_usd"]) + miss_usd * (1.0 - float(m["slo_attainment"])) * float(m["requests"])


@dataclass
class WindowResult:
    """One gate window: every planner's result (``models.capacity_eval.PlannerResult``) and its best baseline."""

    label: str
    results: list[PlannerResult]
    best_baseline: str
    requests: int = 0

    def result(self, name: str) -> PlannerResult:
        return next(r for r in self.results if r.name == name)

    def ratio(self, name: str, to: str | None = None) -> np.ndarray:
        """Per seed, ``name``'s held cost over ``to``'s (default: the best baseline's)."""
        a, b = self.result(name), self.result(to or self.best_baseline)
        return np.array([x.metrics["cost_usd"] / y.metrics["cost_usd"] for x, y in zip(a.runs, b.runs)])

    def gap_closed(self, name: str) -> np.ndarray:
        """Per seed, (best baseline's cost - ``name``'s) / (best baseline's - the oracle's)."""
        a, b, o = self.result(name), self.result(self.best_baseline), self.result(ORACLE)
        return np.array([(y.metrics["cost_usd"] - x.metrics["cost_usd"]) / (y.metrics["cost_usd"] - z.metrics["cost_usd"])
                         if y.metrics["cost_usd"] > z.metrics["cost_usd"] else math.nan
                         for x, y, z in zip(a.runs, b.runs, o.runs)])


def best_baseline(results: list[PlannerResult], miss_usd: float) -> str:
    """The cheapest baseline meeting the SLO target, else the lowest penalized cost (module docstring)."""
    base = [r for r in results if r.name in BASELINES]
    ok = [r for r in base if r.metrics["slo_attainment"] >= SLO_TARGET]
    if ok:
        return min(ok, key=lambda r: r.metrics["cost_usd"]).name
    return min(base, key=lambda r: np.mean([penalized_cost(x.metrics, miss_usd) for x in r.runs])).name


def evaluate_gate(scenarios: list[Scenario], loads: list[int], candidates: dict[str, PlannerWeights],
                  cfg: CapacityConfig, seeds: int, miss_usd: float, echo: Callable[[str], None] | None = None
                  ) -> list[WindowResult]:
    """Every baseline, the oracle and every candidate (name -> weights) on every gate window."""
    out = []
    for sc in scenarios:
        for L in loads:
            c = cfg.model_copy(update={"world": cfg.world.model_copy(update={"load_scale": int(L)})})
            factories = {n: _maker(c, w, n) for n, w in candidates.items()}
            res, world = evaluate_capacity(sc.bundle, [*BASELINES, *candidates, "oracle"], c, sc.history, seeds=seeds,
                                           factories=factories)
            wr = WindowResult(f"{sc.label} x{L}", res, best_baseline(res, miss_usd), world.N)
            out.append(wr)
            if echo is not None:
                parts = ", ".join(f"{n} {_fmt(t_interval(wr.ratio(n)))}" for n in candidates)
                echo(f"gate {wr.label}: best baseline {wr.best_baseline} "
                     f"({wr.result(wr.best_baseline).metrics['cost_per_1k_requests']:.4f} USD/1k); cost x best: {parts}")
    return out


def _maker(cfg: CapacityConfig, weights: PlannerWeights, name: str) -> Callable[[], Any]:
    return lambda: LearnedPlanner(cfg.planners, weights, name=name)


@dataclass
class PlannerGateDecision:
    passed: bool
    reason: str
    candidate: str
    pooled: tuple[float, float, float]
    losses: list[str] = field(default_factory=list)
    wins: list[str] = field(default_factory=list)

    def tags(self, prefix: str = "gate") -> dict[str, Any]:
        m, lo, hi = self.pooled
        return {f"{prefix}_passed": self.passed, f"{prefix}_cost_ratio": m, f"{prefix}_cost_ratio_lo": lo,
                f"{prefix}_cost_ratio_hi": hi, f"{prefix}_losses": ";".join(self.losses) or "none",
                f"{prefix}_wins": ";".join(self.wins) or "none", f"{prefix}_reason": self.reason[:500]}


def decide(results: list[WindowResult], candidate: str) -> PlannerGateDecision:
    """The gate's verdict for ``candidate`` (module docstring)."""
    per_seed = np.mean(np.stack([r.ratio(candidate) for r in results]), axis=0)
    pooled = t_interval(per_seed)
    losses, wins = [], []
    for r in results:
        m, lo, hi = t_interval(r.ratio(candidate))
        slo = r.result(candidate).metrics["slo_attainment"]
        if slo < SLO_TARGET:
            losses.append(f"{r.label} (SLO {100 * slo:.2f} %)")
        elif math.isfinite(lo) and lo > 1:
            losses.append(f"{r.label} (cost x{m:.3f})")
        elif math.isfinite(hi) and hi < 1:
            wins.append(r.label)
    m, lo, hi = pooled
    if not math.isfinite(hi):
        return PlannerGateDecision(False, "the gate needs at least two seeds for an interval", candidate, pooled,
                                   losses, wins)
    if losses:
        return PlannerGateDecision(False, f"{candidate} loses where it was not trained: {', '.join(losses)} "
                                          f"(pooled cost x best baseline {_fmt(pooled)})", candidate, pooled, losses, wins)
    if hi >= 1:
        return PlannerGateDecision(False, f"{candidate} is not cheaper than the best baseline beyond noise: pooled cost "
                                          f"x {_fmt(pooled)} over {len(results)} unseen windows (the upper bound must "
                                          "be < 1)", candidate, pooled, losses, wins)
    return PlannerGateDecision(True, f"{candidate} holds the SLO target and costs {_fmt(pooled)} x the best baseline "
                                     f"on {len(results)} unseen windows, significantly less in {len(wins)}, lost in none",
                               candidate, pooled, losses, wins)


def markdown(results: list[WindowResult], candidates: list[str]) -> str:
    """One row per window: the best baseline (USD/1k, SLO), the oracle, and per candidate its USD/1k,
    SLO, paired cost ratio to the best baseline and to SpotHedge and the gap closed (95 % intervals)."""
    head = ["window", "best baseline: USD/1k (SLO %)", "oracle: USD/1k"]
    for n in candidates:
        head += [f"{n}: USD/1k (SLO %)", f"{n}: × best baseline", f"{n}: × SpotHedge", f"{n}: gap closed"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        b = r.result(r.best_baseline).metrics
        row = [r.label, f"{r.best_baseline} {b['cost_per_1k_requests']:.4f} ({100 * b['slo_attainment']:.2f})",
               f"{r.result(ORACLE).metrics['cost_per_1k_requests']:.4f}"]
        for n in candidates:
            m = r.result(n).metrics
            row += [f"{m['cost_per_1k_requests']:.4f} ({100 * m['slo_attainment']:.2f})", _fmt(t_interval(r.ratio(n)), 3),
                    _fmt(t_interval(r.ratio(n, "spothedge")), 3), _fmt(t_interval(r.gap_closed(n)), 2)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[WindowResult], candidates: list[str], path: str | Path, title: str = "") -> None:
    """Per window, each candidate's and the oracle's held cost over the best baseline's (95 % interval):
    below 1 is cheaper."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*candidates, "spothedge", ORACLE]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(results) + 2), 4.2))
    width = 0.8 / len(names)
    x = np.arange(len(results))
    for k, n in enumerate(names):
        ivs = [t_interval(r.ratio(n)) for r in results]
        m = np.array([iv[0] for iv in ivs])
        err = np.array([[iv[0] - iv[1], iv[2] - iv[0]] if math.isfinite(iv[1]) else [0.0, 0.0] for iv in ivs]).T
        ax.bar(x + (k - (len(names) - 1) / 2) * width, m, width, yerr=err, capsize=2, label=n)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(x, [r.label for r in results], fontsize=8)
    ax.set_ylabel("held cost / the best baseline's (paired)")
    ax.set_title(title or "gate: the test windows no training or selection saw", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(iv: tuple[float, float, float], digits: int = 3) -> str:
    m, lo, hi = iv
    if not math.isfinite(m):
        return "-"
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]" if math.isfinite(lo) else f"{m:.{digits}f}"
