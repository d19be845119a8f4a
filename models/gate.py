"""The promotion gate: does a learned router beat the best baseline on data no selection saw?

``xroute train`` runs the learned router (and, for the ablation, its warm start alone) beside every
baseline on each gate scenario -- the test windows of the gate bundles at each gate load
(``models.scenarios``) -- for several seeds, paired by seed. Per scenario, the comparator is the
baseline with the best mean reward there. The gate passes when

* the **pooled** paired difference in mean reward (per seed, the mean over scenarios of the
  router's reward minus the best baseline's; a 95 % t-interval over the seeds) has its lower bound
  above zero, and
* **no scenario** shows a significant loss (a per-scenario interval entirely below zero), and
* in **every family at every load** the router is **non-inferior to greedy**: in each scenario the
  95 % interval of its paired difference to greedy lies above minus the margin, the larger of
  ``data.gate_margin`` and ``data.gate_margin_rel`` x greedy's |mean reward| there (one margin in
  reward units would be noise in the overload scenario, whose rewards are 30x the others'). The
  families (``Scenario.family``): a shipped bundle's windows, the overload scenario, each
  ``data.gate_families`` entry (other SLO recipes and tenant mixes, scarce or ample capacity); the
  report also gives each family's pooled difference. A router that is worse than greedy on some kind
  of traffic is worse than no learning there, however well it does pooled.

Otherwise the challenger is not promoted and the router keeps serving the champion or, with none,
the fallback baseline: it does not lose quietly where it was not trained. ``xroute promote`` reads
the verdict from the registered version's tags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.baselines import Greedy
from models.scenarios import Scenario, eval_env_config
from xroute.config import EvaluateConfig

#: what every router must be non-inferior to on every family
GREEDY = Greedy.name


def noninferiority_margin(greedy_reward: float, margin: float, margin_rel: float) -> float:
    """How far below greedy a router may be and still count as non-inferior where greedy's mean
    reward is ``greedy_reward``: the larger of ``margin`` (``data.gate_margin``) and ``margin_rel``
    x greedy's |reward| (``data.gate_margin_rel``); ``margin`` where greedy's reward is not finite.
    The gate's rule, and the departure margin's calibration on the selection windows
    (``models.callbacks.Selection``)."""
    return max(margin, margin_rel * abs(greedy_reward)) if math.isfinite(greedy_reward) else margin


@dataclass
class ScenarioResult:
    label: str
    results: list[Any]  # models.evaluate.PolicyResult
    best_baseline: str
    #: policy name -> per-seed differences of mean reward to the best baseline
    deltas: dict[str, np.ndarray] = field(default_factory=dict)
    family: str = ""
    #: policy name -> per-seed differences of mean reward to greedy
    vs_greedy: dict[str, np.ndarray] = field(default_factory=dict)
    #: greedy's mean reward there (the scale of the non-inferiority margin)
    greedy_reward: float = float("nan")

    def margin(self, margin: float, margin_rel: float) -> float:
        """The non-inferiority margin here: ``max(margin, margin_rel x |greedy's mean reward|)``."""
        return noninferiority_margin(self.greedy_reward, margin, margin_rel)

    def non_inferior(self, name: str, margin: float, margin_rel: float) -> bool:
        from models.evaluate import t_interval

        lo = t_interval(self.vs_greedy[name])[1]
        return math.isfinite(lo) and lo > -self.margin(margin, margin_rel)

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
    #: family -> the candidate's paired difference to greedy there (mean, 95 % interval)
    families: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    #: the scenarios where the interval to greedy does not lie above minus their margin
    inferior: list[str] = field(default_factory=list)
    margin: float = 0.0
    margin_rel: float = 0.0

    def tags(self, prefix: str = "gate") -> dict[str, Any]:
        m, lo, hi = self.pooled
        return {f"{prefix}_passed": self.passed, f"{prefix}_reward_delta": m, f"{prefix}_reward_delta_lo": lo,
                f"{prefix}_reward_delta_hi": hi, f"{prefix}_losses": ";".join(self.losses) or "none",
                f"{prefix}_wins": ";".join(self.wins) or "none", f"{prefix}_reason": self.reason[:500],
                f"{prefix}_inferior": ";".join(self.inferior) or "none", f"{prefix}_margin": self.margin,
                f"{prefix}_margin_rel": self.margin_rel}


def family_intervals(results: list[ScenarioResult], candidate: str) -> dict[str, tuple[float, float, float]]:
    """Per family (in the order first seen): ``candidate``'s paired difference to greedy, per seed
    the mean over the family's scenarios, as a 95 % t-interval."""
    from models.evaluate import t_interval

    fams: dict[str, list[np.ndarray]] = {}
    for r in results:
        fams.setdefault(r.family or r.label, []).append(r.vs_greedy[candidate])
    return {f: t_interval(np.mean(np.stack(v), axis=0)) for f, v in fams.items()}


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
        greedy = next(r for r in res if r.name == GREEDY)
        sr = ScenarioResult(s.label, res, best.name, family=s.family,
                            greedy_reward=float(greedy.metrics["mean_reward"]))
        for r in res:
            sr.deltas[r.name] = np.array([a.metrics["mean_reward"] - b.metrics["mean_reward"]
                                          for a, b in zip(r.runs, best.runs)])
            sr.vs_greedy[r.name] = np.array([a.metrics["mean_reward"] - b.metrics["mean_reward"]
                                             for a, b in zip(r.runs, greedy.runs)])
        out.append(sr)
        if echo is not None:
            parts = ", ".join(f"{n} {_fmt(sr.interval(n))}" for n in routers)
            echo(f"gate {s.label}: best baseline {best.name} ({best.metrics['mean_reward']:.5f}); Δ reward {parts}")
    return out


def decide(results: list[ScenarioResult], candidate: str, margin: float = 0.0002,
           margin_rel: float = 0.0025) -> GateDecision:
    """The gate's verdict for ``candidate`` (module docstring); ``margin``, ``margin_rel``: the
    non-inferiority margin to greedy in every scenario (``data.gate_margin``, ``data.gate_margin_rel``)."""
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
    families = family_intervals(results, candidate)
    inferior = [r.label for r in results if not r.non_inferior(candidate, margin, margin_rel)]

    def verdict(passed: bool, reason: str) -> GateDecision:
        return GateDecision(passed, reason, candidate, pooled, losses, wins, families, inferior, margin, margin_rel)

    m, lo, hi = pooled
    if not math.isfinite(lo):
        return verdict(False, "the gate needs at least two seeds for an interval")
    if losses:
        return verdict(False, f"{candidate} loses to the best baseline where it was not trained: {', '.join(losses)} "
                              f"(pooled Δ reward {_fmt(pooled)})")
    if lo <= 0:
        return verdict(False, f"{candidate} does not beat the best baseline beyond noise: pooled Δ reward "
                              f"{_fmt(pooled)} over {len(results)} unseen scenarios (the lower bound must be > 0)")
    if inferior:
        by = {r.label: r for r in results}
        worst = ", ".join(f"{x} ({by[x].family}) {_fmt(t_interval(by[x].vs_greedy[candidate]))} vs "
                          f"-{by[x].margin(margin, margin_rel):.5f}" for x in inferior)
        return verdict(False, f"{candidate} is not non-inferior to greedy in every family and load: {worst}")
    return verdict(True, f"{candidate} beats the best baseline on {len(results)} unseen scenarios: pooled Δ reward "
                         f"{_fmt(pooled)}, significant in {len(wins)}, lost in none; non-inferior to greedy in all "
                         f"{len(families)} families at every load")


def families_markdown(results: list[ScenarioResult], routers: list[str], margin: float,
                      margin_rel: float = 0.0025) -> str:
    """One row per family: its scenarios, each router's paired difference to greedy pooled over
    them, and whether it is non-inferior in each of them (else which not)."""
    head = ["family", "scenarios"] + [f"{n}: Δ vs greedy (pooled)" for n in routers]
    head += [f"{n}: non-inferior in each" for n in routers]
    head += [f"{n}: departs / gain per departure" for n in routers]
    per = {n: family_intervals(results, n) for n in routers}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fam in per[routers[0]]:
        mine = [r for r in results if (r.family or r.label) == fam]
        row = [fam, "; ".join(r.label for r in mine)] + [_fmt(per[n][fam]) for n in routers]
        for n in routers:
            bad = [r.label for r in mine if not r.non_inferior(n, margin, margin_rel)]
            row.append("**no**: " + "; ".join(bad) if bad else "yes")
        for n in routers:
            share = float(np.mean([departure_share(r, n) for r in mine]))
            delta = float(np.mean([np.mean(r.vs_greedy[n]) for r in mine]))
            row.append(f"{100 * share:.1f} % / {_per_departure(delta, share)}" if math.isfinite(share) else "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: list[ScenarioResult], routers: list[str]) -> str:
    """One row per scenario: the best baseline and each router's paired Δ reward (95 % CI), how
    often it departs from greedy's choice (``differs_from_greedy``), its paired Δ to greedy and that
    Δ per departure (the reward each departure gained, on average, over serving greedy: Δ to greedy
    x requests / departures), and its Δ per SLO class (tenant)."""
    tenants = sorted({k[len("mean_reward["):-1] for r in results for k in r.results[0].metrics
                      if k.startswith("mean_reward[")})
    head = ["scenario", "best baseline (reward)"]
    for n in routers:
        head += [f"{n}: Δ reward", f"{n}: departs from greedy", f"{n}: Δ vs greedy", f"{n}: gain per departure"]
        head += [f"{n}: Δ {t}" for t in tenants]
    from models.evaluate import t_interval

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        best = r.result(r.best_baseline)
        row = [r.label, f"{r.best_baseline} ({best.metrics['mean_reward']:.5f})"]
        for n in routers:
            p = r.result(n)
            share = p.metrics.get('differs_from_greedy', float('nan'))
            row += [_fmt(r.interval(n)), f"{100 * share:.1f} %", _fmt(t_interval(r.vs_greedy[n])),
                    _per_departure(float(np.mean(r.vs_greedy[n])), share)]
            for t in tenants:
                k = f"mean_reward[{t}]"
                row.append(f"{p.metrics.get(k, float('nan')) - best.metrics.get(k, float('nan')):+.5f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def departure_share(r: ScenarioResult, name: str) -> float:
    """How often ``name`` departs from greedy's choice in scenario ``r`` (mean over seeds; NaN when
    not measured)."""
    p = next((x for x in r.results if x.name == name), None)
    return float("nan") if p is None else float(p.metrics.get("differs_from_greedy", float("nan")))


def _per_departure(delta: float, share: float) -> str:
    """A paired Δ per request as the Δ per departure (``—`` without departures)."""
    return f"{delta / share:+.5f}" if math.isfinite(share) and share > 0 else "—"


def _fmt(iv: tuple[float, float, float]) -> str:
    m, lo, hi = iv
    return f"{m:+.5f} [{lo:+.5f}, {hi:+.5f}]" if math.isfinite(lo) else f"{m:+.5f}"
