"""The promotion gate: does a learned router beat the best baseline on data no selection saw?

``xroute train`` runs the learned router (and, for the ablation, its warm start alone) beside every
baseline on each gate scenario -- the test windows of the gate bundles at each gate load
(``models.scenarios``) -- for several seeds, paired by seed. Per scenario, the comparator is the
baseline with the best mean reward there. The gate passes when

* the **pooled** paired difference in mean reward (per seed, the mean over scenarios of the
  router's reward minus the best baseline's; a 95 % t-interval over the seeds) has its lower bound
  above zero, and
* **no scenario** shows a significant loss (a per-scenario interval entirely below zero).

Otherwise the challenger is not promoted and the router keeps serving the champion or, with none,
the fallback baseline: it does not lose quietly where it was not trained. ``xroute promote`` reads
the verdict from the registered version's tags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.scenarios import Scenario, eval_env_config
from xroute.config import EvaluateConfig


@dataclass
class ScenarioResult:
    label: str
    results: list[Any]  # models.evaluate.PolicyResult
    best_baseline: str
    #: policy name -> per-seed differences of mean reward to the best baseline
    deltas: dict[str, np.ndarray] = field(default_factory=dict)

    def interval(self, name: str) -> tuple[float, float, float]:
        from models.evaluate import t_interval

        return t_interval(self.deltas[name])

    def result(self, name: str) -> Any:
        return next(r for r in self.results if r.name == name)


@dataclass
class GateDecision:
    passed: bool
    reason: str
    candidate: str
    pooled: tuple[float, float, float]
    losses: list[str]
    wins: list[str]

    def tags(self, prefix: str = "gate") -> dict[str, Any]:
        m, lo, hi = self.pooled
        return {f"{prefix}_passed": self.passed, f"{prefix}_reward_delta": m, f"{prefix}_reward_delta_lo": lo,
                f"{prefix}_reward_delta_hi": hi, f"{prefix}_losses": ";".join(self.losses) or "none",
                f"{prefix}_wins": ";".join(self.wins) or "none", f"{prefix}_reason": self.reason[:500]}


def evaluate_gate(scenarios: list[Scenario], routers: dict[str, str], eval_cfg: EvaluateConfig, seeds: int,
                  baselines: list[str], echo: Any = None) -> list[ScenarioResult]:
    """Every baseline and every router (name -> export directory) on every gate scenario."""
    from models import evaluate as ev

    out = []
    for s in scenarios:
        cfg = eval_cfg.model_copy(update={"env": eval_env_config(eval_cfg, s.rate, s.env)})
        res = ev.evaluate(s.bundle, [*baselines, *routers.values()], cfg, show_progress=False, seeds=seeds,
                          history=s.history)
        names = {d: n for n, d in routers.items()}
        for r in res:
            if r.name in names:
                r.name = names[r.name]
                r.is_baseline = False
        best = ev.best_baseline(res)  # (ev.evaluate compared every result to it already)
        assert best is not None
        sr = ScenarioResult(s.label, res, best.name)
        for r in res:
            sr.deltas[r.name] = np.array([a.metrics["mean_reward"] - b.metrics["mean_reward"]
                                          for a, b in zip(r.runs, best.runs)])
        out.append(sr)
        if echo is not None:
            parts = ", ".join(f"{n} {_fmt(sr.interval(n))}" for n in routers)
            echo(f"gate {s.label}: best baseline {best.name} ({best.metrics['mean_reward']:.5f}); Δ reward {parts}")
    return out


def decide(results: list[ScenarioResult], candidate: str) -> GateDecision:
    """The gate's verdict for ``candidate`` (module docstring)."""
    from models.evaluate import t_interval

    per_seed = np.mean(np.stack([r.deltas[candidate] for r in results]), axis=0)
    pooled = t_interval(per_seed)
    losses, wins = [], []
    for r in results:
        m, lo, hi = r.interval(candidate)
        if math.isfinite(hi) and hi < 0:
            losses.append(r.label)
        if math.isfinite(lo) and lo > 0:
            wins.append(r.label)
    m, lo, hi = pooled
    if not math.isfinite(lo):
        return GateDecision(False, "the gate needs at least two seeds for an interval", candidate, pooled, losses, wins)
    if losses:
        reason = (f"{candidate} loses to the best baseline where it was not trained: {', '.join(losses)} "
                  f"(pooled Δ reward {_fmt(pooled)})")
        return GateDecision(False, reason, candidate, pooled, losses, wins)
    if lo <= 0:
        reason = (f"{candidate} does not beat the best baseline beyond noise: pooled Δ reward {_fmt(pooled)} "
                  f"over {len(results)} unseen scenarios (the lower bound must be > 0)")
        return GateDecision(False, reason, candidate, pooled, losses, wins)
    return GateDecision(True, f"{candidate} beats the best baseline on {len(results)} unseen scenarios: pooled Δ reward "
                              f"{_fmt(pooled)}, significant in {len(wins)}, lost in none", candidate, pooled, losses, wins)


def markdown(results: list[ScenarioResult], routers: list[str]) -> str:
    """One row per scenario: the best baseline and each router's paired Δ reward (95 % CI), how
    often it decides differently from greedy, and its Δ per SLO class (tenant)."""
    tenants = sorted({k[len("mean_reward["):-1] for r in results for k in r.results[0].metrics
                      if k.startswith("mean_reward[")})
    head = ["scenario", "best baseline (reward)"]
    for n in routers:
        head += [f"{n}: Δ reward", f"{n}: differs from greedy"] + [f"{n}: Δ {t}" for t in tenants]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        best = r.result(r.best_baseline)
        row = [r.label, f"{r.best_baseline} ({best.metrics['mean_reward']:.5f})"]
        for n in routers:
            p = r.result(n)
            row += [_fmt(r.interval(n)), f"{100 * p.metrics.get('differs_from_greedy', float('nan')):.1f} %"]
            for t in tenants:
                k = f"mean_reward[{t}]"
                row.append(f"{p.metrics.get(k, float('nan')) - best.metrics.get(k, float('nan')):+.5f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _fmt(iv: tuple[float, float, float]) -> str:
    m, lo, hi = iv
    return f"{m:+.5f} [{lo:+.5f}, {hi:+.5f}]" if math.isfinite(lo) else f"{m:+.5f}"
