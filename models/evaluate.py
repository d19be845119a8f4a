"""Replay one request stream through several policies and compare them (``xroute evaluate``).

Every policy is run on the same stream with ``seeds`` different seeds (each seed draws the
service-time noise and the instants at which spot preemptions really happen, see ``EnvConfig.
spot_lag_s``); every policy sees the same draws for a seed (common random numbers), so policies
are compared *paired by seed*. Each metric is reported as its mean over the seeds with a 95 %
t-interval, and each policy's difference to the best baseline (the non-learned policy with the
best mean reward; the hindsight oracle is a reference, not a baseline) as the mean of the per-seed
differences with its 95 % t-interval. The intervals cover the simulation's randomness on *this*
request stream, not other traffic: how a policy generalizes is measured on other bundles.

It lives with the policies it runs because training uses it too (the selection runs, the promotion
gate, the reports of ``xroute train``); the ``xroute evaluate`` command only reads its options and calls it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from envs.cloud_route import CloudRouteEnv
from models.baselines import BASELINES, Policy, make_baseline, policy_bias
from models.policy import greedy_choice
from xroute.bundle import Bundle
from xroute.config import EvaluateConfig
from xroute.errors import ConfigError

METRICS = ("requests", "cost_usd", "cost_per_1k_requests", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
           "ttft_p95_ms", "sla_attainment", "failed_requests", "preempted", "migrations", "mean_reward",
           "refused_budget", "refused_rate_limit", "excluded_budget", "excluded_quota", "tokens_recomputed",
           "kv_gb_moved", "missed_window")
#: the metrics compared pairwise to the best baseline (higher is better for reward and SLA)
PAIRED = ("mean_reward", "cost_per_1k_requests", "latency_p95_ms", "sla_attainment", "failed_requests")

Progress = Callable[[str, int, int, int, int], None]


@dataclass
class PolicyRun:
    """One policy on one seed: its metrics and the per-request series the plots use."""

    name: str
    metrics: dict[str, float]
    t: np.ndarray = field(repr=False)
    cum_cost: np.ndarray = field(repr=False)
    #: the offerings chosen, request by request, and the summed reward (in order: as a planner sums)
    actions: np.ndarray | None = field(default=None, repr=False)
    total_reward: float = float("nan")
    #: each request's reward, in order (paired request by request with another policy's on the same seed)
    rewards: np.ndarray | None = field(default=None, repr=False)


@dataclass
class PolicyResult:
    """One policy over every seed: the mean of each metric (``metrics``), its 95 % interval
    (``ci``), and the paired difference to the best baseline (``vs_best``: metric -> (mean, lo,
    hi)); intervals are NaN with a single seed."""

    name: str
    runs: list[PolicyRun]
    metrics: dict[str, float] = field(default_factory=dict)
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    vs_best: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    wall_s: float = 0.0
    is_baseline: bool = True
    #: the paired differences are taken to this policy (``evaluate(versus=...)``) rather than to the best baseline
    is_reference: bool = False

    @property
    def t(self) -> np.ndarray:
        return self.runs[0].t

    @property
    def cum_cost(self) -> np.ndarray:
        return self.runs[0].cum_cost


def resolve_policy(name: str, cfg: EvaluateConfig) -> Policy:
    """A baseline name, ``static:OFFERING_ID``, or a learned policy (``models:/NAME@ALIAS`` or a path)."""
    if name.startswith("models:/") or name.startswith("runs:/") or Path(name).exists():
        from models.loader import load_policy  # the learned router; imports torch-free numpy code only

        return load_policy(name)
    return make_baseline(name, cfg)


def is_baseline(name: str) -> bool:
    """A policy anyone can run without training or hindsight (the reference of paired differences)."""
    return (name in BASELINES and name != "oracle") or name.startswith("static:")


def known_plans(runs: list[PolicyRun]) -> dict[str, tuple[list[int], float]]:
    """The baselines' runs (one seed, one environment) as the plans the oracle would otherwise play
    again itself (``models.baselines.Oracle.known``): name -> (actions, total reward)."""
    return {r.name: (r.actions.tolist(), r.total_reward) for r in runs
            if r.name in BASELINES and r.name != "oracle" and r.actions is not None}


def run_policy(env: CloudRouteEnv, policy: Policy, seed: int,
               progress: Callable[[int], None] | None = None, compare_greedy: bool | None = None) -> PolicyRun:
    """One pass of ``policy`` over ``env``'s episode for ``seed``. With ``compare_greedy`` (the
    default for a learned policy) it also counts the decisions where greedy would have chosen
    another offering (``differs_from_greedy``: the share of requests)."""
    obs, info = env.reset(seed=seed)
    policy.reset(env, seed)
    if compare_greedy is None:
        compare_greedy = hasattr(policy, "weights")
    n = env._end - env._pos
    i0 = env._pos
    differs = 0
    rewards = np.empty(n)
    costs = np.empty(n)
    lats = np.empty(n)
    ttfts = np.empty(n)
    viol = np.empty(n, dtype=bool)
    ts = np.empty(n)
    actions = np.empty(n, dtype=np.int64)
    total_reward = 0.0
    failed = migrations = preempted = 0
    pol = env.policies  # the routing policies (envs.policies): what each excludes, request by request
    excluded = np.zeros(pol.R if pol is not None else 0, dtype=np.int64)
    affected = np.zeros_like(excluded)
    prompt_tokens = cached_tokens = 0.0
    recomputed = kv_moved = 0.0  # spot notices and migration (xroute.migration_rules, docs/env.md)
    missed: list[int] = []
    placed = np.full(n, -1, dtype=np.int64)
    adm = _AdmissionLog(n)  # admission under load (envs.admission): each step's band, tenant, verdict, wait
    for k in range(n):
        ts[k] = info["t"]
        if pol is not None:
            out = env.r_policy
            if out.excluded:
                c = out.counts[: pol.R]
                excluded += c
                affected += c > 0
        a = policy.act(obs, info)
        actions[k] = a
        if compare_greedy:  # (the departures from greedy: its choice with the policies' bias, as it decides)
            differs += greedy_choice(env.expected_rewards(), policy_bias(info, env.n)) != a
        pos = env._pos
        obs, r, _term, trunc, info = env.step(a)
        rewards[k], costs[k], lats[k], ttfts[k], viol[k] = (r, info["cost_usd"], info["latency_ms"], info["ttft_ms"],
                                                             info["sla_violation"])
        total_reward += r
        adm.record(k, pos, info)
        failed += bool(info["failed"])
        preempted += bool(info["preempted"])
        migrations += info["migrated_to"] is not None
        prompt_tokens += info.get("prompt_tokens", 0.0)
        cached_tokens += info.get("cached_tokens", 0.0)
        recomputed += info.get("tokens_recomputed", 0.0)
        kv_moved += info.get("kv_bytes_moved", 0.0)
        if info.get("missed_window"):
            missed.append(pos - i0)
        if not info["failed"]:
            placed[pos - i0] = info["offering"] if info["migrated_to"] is None else info["migrated_to"]
        if progress is not None and (k % 500 == 499 or trunc):
            progress(k % 500 + 1)
    served = lats[~np.isnan(lats)]
    p50, p95, p99 = (np.percentile(served, [50, 95, 99]) if served.size else (np.nan,) * 3)
    tt = ttfts[~np.isnan(ttfts)]
    total = float(costs.sum())
    m = {
        "requests": n, "cost_usd": round(total, 6), "cost_per_1k_requests": round(1000.0 * total / n, 6),
        "latency_p50_ms": round(float(p50), 2), "latency_p95_ms": round(float(p95), 2),
        "latency_p99_ms": round(float(p99), 2),
        "ttft_p95_ms": round(float(np.percentile(tt, 95)), 2) if tt.size else float("nan"),
        "sla_attainment": round(float(1.0 - viol.mean()), 6), "failed_requests": int(failed),
        "preempted": int(preempted), "migrations": int(migrations), "mean_reward": round(float(rewards.mean()), 6),
        # the tenant budgets and cloud quotas (envs.budget, envs.capacity): requests refused for a tenant's
        # USD budget or its rate limits (failed requests, counted in failed_requests too), and offerings
        # excluded per request for a budget and for a cloud capacity quota
        "refused_budget": int(env.stats["refused_budget"]), "refused_rate_limit": int(env.stats["refused_rate_limit"]),
        "excluded_budget": round(env.stats["excluded_budget"] / max(n, 1), 4),
        "excluded_quota": round(env.stats["excluded_quota"] / max(n, 1), 4),
        # migration off spot pools (docs/env.md, "Preemption and migration"): the requests moved off a
        # preempted pool ("migrations", above), the tokens whose KV was computed again (work lost), the KV
        # cache moved between pools, and the requests whose migration missed its notice window
        "tokens_recomputed": round(recomputed), "kv_gb_moved": round(kv_moved / 1e9, 6), "missed_window": len(missed),
    }
    if compare_greedy:
        m["differs_from_greedy"] = round(differs / max(n, 1), 6)
    if pol is not None:  # per routing policy: offerings it excluded per request, share of requests it excluded any
        for r, name in enumerate(pol.names):
            m[f"policy_excluded[{name}]"] = round(float(excluded[r]) / max(n, 1), 4)
            m[f"policy_affected[{name}]"] = round(float(affected[r]) / max(n, 1), 6)
    if prompt_tokens > 0:  # prefix-bearing requests: the servers' prefix caches (envs.prefix)
        m["prefix_hit_rate"] = round(cached_tokens / prompt_tokens, 6)
        m["prefill_tokens_saved"] = round(cached_tokens)
    sessions = getattr(env, "req_session", None)
    if sessions is not None and (sessions[i0:i0 + n] >= 0).any():
        moves, moved = session_moves(sessions[i0:i0 + n], placed)
        m["session_moves"], m["sessions_moved"] = moves, moved
        m["sessions_missed_window"] = len({int(sessions[i0 + k]) for k in missed} - {-1})
    adm.finish(env)
    if "tenant" in env.bundle.workload.columns:  # the reward by SLO class (the tenants are services with their own SLO)
        for t in sorted(set(adm.tenant)):
            m[f"mean_reward[{t}]"] = round(float(rewards[adm.tenant == t].mean()), 6)
    m.update(adm.metrics(env, viol, lats))
    return PolicyRun(getattr(policy, "display_name", policy.name), m, ts, np.cumsum(costs), actions, total_reward,
                     rewards)


class _AdmissionLog:
    """Each step's request (its position in the stream: its band, tenant, arrival and service are the
    environment's) and what the admission did to it (``info``'s ``admission`` and ``queue_wait_ms``,
    present only when it acted: else admitted at its arrival), for the per-band and per-tenant report
    (:meth:`metrics`)."""

    def __init__(self, n: int):
        self.pos = np.zeros(n, dtype=np.int64)
        self.verdict = np.full(n, "admit", dtype=object)
        self.wait = np.zeros(n)

    def record(self, k: int, pos: int, info: dict[str, Any]) -> None:
        self.pos[k] = pos
        if "admission" in info:
            self.verdict[k], self.wait[k] = info["admission"], info["queue_wait_ms"]

    def finish(self, env: CloudRouteEnv) -> None:
        """Each step's band, tenant, arrival and weighted service (``admission_rules.service`` at its
        realized output, weight 1) from the environment's arrays."""
        from xroute import admission_rules as ar

        p = self.pos
        self.band = np.array([ar.BANDS[int(b)] for b in env.req_band[p]], dtype=object)
        self.tenant = np.asarray(env.req_tenant[p]).astype(str).astype(object)
        self.arrival = np.asarray(env.arrival[p], dtype=float)
        self.service = np.array([ar.service(i, o, 1.0) for i, o in zip(env.req_in[p].tolist(),
                                                                         env.req_out[p].tolist())])

    def metrics(self, env: CloudRouteEnv, viol: np.ndarray, lats: np.ndarray) -> dict[str, float]:
        """Per band and per tenant: SLO attainment, goodput (requests served within their SLO per
        second of the stream), shed and queued counts, the queue wait p95 (of those that waited);
        per band, Jain's index of the normalized service of its backlogged tenants (``jain[band]``):
        each tenant's service over its max-min fair share (``admission_rules.fair_shares``, weighted)
        of what the band was served, among the tenants that had a request wait in the queue."""
        from xroute import admission_rules as ar

        span = float(np.nanmax(self.arrival) - np.nanmin(self.arrival)) if len(self.arrival) else 0.0
        span = max(span, 1e-9)
        good = ~viol & ~np.isnan(lats)
        out: dict[str, float] = {"shed": int((self.verdict == "shed").sum()),
                                 "queued": int((self.verdict == "queued").sum() + ((self.verdict == "shed")
                                                                                  & (self.wait > 0)).sum()),
                                 "goodput_rps": round(float(good.sum()) / span, 4)}
        for key, col in (("band", self.band), ("tenant", self.tenant)):
            for v in sorted(set(col.tolist())):
                sel = col == v
                waited = self.wait[sel & (self.wait > 0)]
                out[f"slo_attainment[{key}={v}]"] = round(float(good[sel].mean()), 6)
                out[f"goodput_rps[{key}={v}]"] = round(float(good[sel].sum()) / span, 4)
                out[f"shed[{key}={v}]"] = int((self.verdict[sel] == "shed").sum())
                out[f"queued[{key}={v}]"] = int((self.wait[sel] > 0).sum())
                out[f"queue_wait_p95_ms[{key}={v}]"] = round(float(np.percentile(waited, 95)), 2) if waited.size else 0.0
        weights = env.admission.weight if env.admission is not None else {}
        for b in sorted(set(self.band.tolist())):
            sel = self.band == b
            backlogged = sorted({t for t in self.tenant[sel & (self.wait > 0)].tolist()})
            if len(backlogged) < 2:
                continue
            demand = [float(self.service[sel & (self.tenant == t)].sum()) for t in backlogged]
            served = ~np.isnan(lats)
            got = [float(self.service[sel & (self.tenant == t) & served].sum()) for t in backlogged]
            w = [weights.get(t, 1.0) for t in backlogged]
            fair = ar.fair_shares(demand, w, sum(got))
            out[f"jain[band={b}]"] = round(ar.jain([g / f if f > 0 else 1.0 for g, f in zip(got, fair)]), 6)
        return out


def session_moves(sessions: np.ndarray, served: np.ndarray) -> tuple[int, int]:
    """(requests served on another offering than their session's previous served request, sessions
    with at least one such move), from each request's session (-1: none) and served offering (-1:
    failed, skipped)."""
    last: dict[int, int] = {}
    moved: set[int] = set()
    moves = 0
    for s, a in zip(sessions.tolist(), served.tolist()):
        if s < 0 or a < 0:
            continue
        prev = last.get(s)
        if prev is not None and prev != a:
            moves += 1
            moved.add(s)
        last[s] = a
    return moves, len(moved)


def tune_pacing_gain(windows: list[tuple[Bundle, pd.DataFrame | None]], cfg: EvaluateConfig, gains: list[float],
                     rate_scales: list[float], seeds: int = 1) -> tuple[float, list[dict[str, Any]]]:
    """The budget-pacing baseline's gain (``models.baselines.BudgetPacing``) with the best mean
    reward over ``windows`` (bundles with the history before each) at each of ``rate_scales`` and
    ``seeds`` seeds -- meant for the training windows only, so the baseline a trained router is
    compared with is tuned on no data it is judged on. Ties go to the smaller gain (the one
    closer to greedy). Returns the gain and one row per gain (its mean reward, refusals)."""
    from envs.cloud_route import CloudRouteEnv
    from models.baselines import BudgetPacing
    from xroute.config import EnvConfig

    envs = [CloudRouteEnv(b, EnvConfig.model_validate({**cfg.env.model_dump(), "rate_scale": r,
                                                       "episode_requests": None}), history=h)
            for b, h in windows for r in rate_scales]
    rows = []
    for g in sorted(gains):
        runs = [run_policy(env, BudgetPacing(g), cfg.seed + s).metrics for env in envs for s in range(seeds)]
        rows.append({"gain": g, "mean_reward": float(np.mean([m["mean_reward"] for m in runs])),
                     "refused_budget": int(sum(m["refused_budget"] for m in runs)),
                     "refused_rate_limit": int(sum(m["refused_rate_limit"] for m in runs))})
    best = max(rows, key=lambda r: (round(r["mean_reward"], 9), -r["gain"]))
    return float(best["gain"]), rows


def t_interval(x: np.ndarray) -> tuple[float, float, float]:
    """(mean, lower, upper) of the 95 % t-interval of the mean of ``x`` (NaN bounds for one value)."""
    from scipy import stats

    x = np.asarray(x, dtype=float)
    mean = float(x.mean())
    if x.size < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


class _Lines:
    """Progress as plain lines (every ``every_s`` seconds and at each end) when output is not a
    terminal -- CI logs, ``| tee``, a job scheduler -- where a redrawn bar would show nothing."""

    def __init__(self, every_s: float = 10.0, stream: Any = None):
        self.every_s, self.stream = every_s, stream or sys.stderr
        self.last = 0.0

    def __call__(self, label: str, seed_i: int, n_seeds: int, done: int, total: int, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last >= self.every_s:
            self.last = now
            print(f"evaluate: {label} seed {seed_i}/{n_seeds}: {done:,}/{total:,} requests "
                  f"({100 * done // max(total, 1)} %)", file=self.stream, flush=True)


def evaluate(bundle: Bundle, policies: list[str], cfg: EvaluateConfig, show_progress: bool = True,
             seeds: int | None = None, history: pd.DataFrame | None = None, versus: str | None = None
             ) -> list[PolicyResult]:
    """Run every policy on ``bundle`` for ``seeds`` seeds (``cfg.seed``, ``cfg.seed + 1``, ...)
    and compare them (module docstring). ``history``: requests before the bundle's stream, whose
    outputs the routers' estimators start from. ``versus``: the policy the paired differences are
    taken to (one of ``policies``; default the best baseline)."""
    n_seeds = cfg.seeds if seeds is None else seeds
    env = CloudRouteEnv(bundle, cfg.env, history=history)
    resolved = [(p, resolve_policy(p, cfg)) for p in policies]
    total = env.n_requests if cfg.env.episode_requests is None else cfg.env.episode_requests
    results: list[PolicyResult] = []
    tty = show_progress and sys.stderr.isatty()
    lines = _Lines() if show_progress and not tty else None
    bar_ctx: Any
    if tty:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar_ctx = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), transient=False)
    else:
        from contextlib import nullcontext

        bar_ctx = nullcontext()
    with bar_ctx as bar:
        for label, pol in resolved:
            t0 = time.perf_counter()
            task = bar.add_task(label, total=total * n_seeds) if bar is not None else None
            runs = []
            for s in range(n_seeds):
                done = [0]

                def advance(k: int, s: int = s, done: list[int] = done, label: str = label, task: Any = task) -> None:
                    done[0] += k
                    if bar is not None:
                        bar.advance(task, k)
                    if lines is not None:  # a line every 10 s, and one when the policy's last seed ends
                        lines(label, s + 1, n_seeds, done[0], total, final=done[0] >= total and s == n_seeds - 1)

                if hasattr(pol, "on_progress"):  # the oracle plans the whole stream first: show it
                    def planning(name: str, p: int, n: int, d: int, tot: int, task: Any = task, label: str = label,
                                 s: int = s) -> None:
                        if bar is not None:
                            bar.update(task, description=f"{label} (plan {p}/{n} {name}: {100 * d // max(tot, 1)}%)")
                        if lines is not None:
                            lines(f"{label} (planning {p}/{n}: {name})", s + 1, n_seeds, d, tot)

                    pol.on_progress = planning
                if hasattr(pol, "known"):  # the oracle: the baselines evaluated before it need no second play
                    pol.known[cfg.seed + s] = known_plans([r.runs[s] for r in results])
                run = run_policy(env, pol, cfg.seed + s, progress=advance)
                run.name = label
                runs.append(run)
            if bar is not None:
                bar.update(task, description=label)
            label = getattr(pol, "display_name", None) or label
            res = PolicyResult(label, runs, wall_s=round(time.perf_counter() - t0, 2), is_baseline=is_baseline(label))
            extra = [k for k in runs[0].metrics if k not in METRICS and all(k in r.metrics for r in runs)]
            for k in (*METRICS, *extra):
                mean, lo, hi = t_interval(np.array([r.metrics[k] for r in runs], dtype=float))
                res.metrics[k] = mean
                res.ci[k] = (lo, hi)
            res.metrics["wall_s"] = res.wall_s
            res.metrics["requests_per_s"] = round(total * n_seeds / max(res.wall_s, 1e-9), 1)
            results.append(res)
    compare_to_best(results, versus)
    return results


def best_baseline(results: list[PolicyResult]) -> PolicyResult | None:
    """The reference of the paired differences: the policy ``compare_to_best`` was told to compare
    to (``is_reference``), else the baseline with the best mean reward."""
    for r in results:
        if r.is_reference:
            return r
    cands = [r for r in results if r.is_baseline]
    return max(cands, key=lambda r: r.metrics["mean_reward"]) if cands else None


def compare_to_best(results: list[PolicyResult], versus: str | None = None) -> None:
    """Fill every result's ``vs_best``: per-seed differences to the best baseline (or to the
    policy named ``versus``), paired by seed."""
    if versus is not None:
        if versus not in [r.name for r in results]:
            raise ConfigError(f"--versus: '{versus}' is not one of the policies evaluated "
                              f"({', '.join(r.name for r in results)})")
        for r in results:
            r.is_reference = r.name == versus
    best = best_baseline(results)
    if best is None:
        return
    for r in results:
        for k in PAIRED:
            d = np.array([a.metrics[k] - b.metrics[k] for a, b in zip(r.runs, best.runs)], dtype=float)
            r.vs_best[k] = t_interval(d)


def report_dict(results: list[PolicyResult], bundle: Bundle, cfg: EvaluateConfig, extra: dict[str, Any]
                ) -> dict[str, Any]:
    cands = [r for r in results if r.is_baseline]
    best = max(cands, key=lambda r: r.metrics["mean_reward"]) if cands else None
    ref = best_baseline(results)

    def clean(x: float) -> float | None:
        return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), 6)

    return {
        "bundle": str(bundle.path), "bundle_hash": bundle.content_hash, "seed": cfg.seed,
        "seeds": len(results[0].runs) if results else 0, "rate_scale": cfg.env.rate_scale,
        "best_baseline": best.name if best else None, **extra,
        "routing_policies": _policies_summary(cfg.env.policies),
        # the paired differences ("vs_best_baseline") are taken to this policy
        "compared_to": ref.name if ref else None,
        "policies": {r.name: {**{k: clean(v) for k, v in r.metrics.items()},
                              "ci95": {k: [clean(lo), clean(hi)] for k, (lo, hi) in r.ci.items()},
                              "vs_best_baseline": {k: {"mean": clean(m), "ci95": [clean(lo), clean(hi)]}
                                                   for k, (m, lo, hi) in r.vs_best.items()},
                              "per_seed": [run.metrics for run in r.runs]}
                     for r in results},
    }


def _policies_summary(policies: Any) -> dict[str, Any] | None:
    """The routing policies the run was under, for the report: their names and version (or the
    file they were read from)."""
    if policies is None:
        return None
    if isinstance(policies, str):
        return {"source": policies}
    return {"version": policies.version, "prefer_mode": policies.prefer_mode,
            "names": [p.name for p in policies.policies]}


def _pm(mean: float, lo: float, hi: float, fmt: str) -> str:
    if not math.isfinite(lo):
        return format(mean, fmt)
    return f"{format(mean, fmt)} ±{format((hi - lo) / 2, fmt.lstrip('+'))}"


def print_table(results: list[PolicyResult], title: str = "xroute evaluate") -> None:
    from rich.console import Console
    from rich.table import Table

    best = best_baseline(results)
    n_seeds = len(results[0].runs) if results else 0
    ref = "" if best is None else f"{best.name}" if best.is_reference else f"the best baseline ({best.name})"
    t = Table(title=title, caption=f"mean over {n_seeds} seed(s) ± half the 95 % interval; Δ = paired difference to "
                                   f"{ref or 'none'}")
    cols = ["policy", "reward", "Δ reward", "$/1k req", "Δ $/1k", "p95 ms", "Δ p95", "TTFT p95", "SLO %", "Δ SLO pp",
            "failed", "refused", "quota excl.", "preempt.", "migr.", "recomp. tok", "KV GB", "missed"]
    prefix = bool(results) and "prefix_hit_rate" in results[0].metrics
    if prefix:
        cols += ["hit %", "saved tok", "sess. moved"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for r in results:
        m, ci, vb = r.metrics, r.ci, r.vs_best
        mark = (" (reference)" if r.is_reference else " (best baseline)") if r is best else ""

        def d(k: str, fmt: str, scale: float = 1.0, vb: dict[str, tuple[float, float, float]] = vb) -> str:
            if k not in vb:
                return "—"
            mean, lo, hi = (x * scale for x in vb[k])
            return _pm(mean, lo, hi, fmt)

        cells = [r.name + mark, _pm(m["mean_reward"], *ci["mean_reward"], ".4f"), d("mean_reward", "+.4f"),
                 _pm(m["cost_per_1k_requests"], *ci["cost_per_1k_requests"], ".4f"), d("cost_per_1k_requests", "+.4f"),
                 f"{m['latency_p95_ms']:.0f}", d("latency_p95_ms", "+.0f"), f"{m['ttft_p95_ms']:.0f}",
                 f"{100 * m['sla_attainment']:.2f}", d("sla_attainment", "+.2f", 100.0), f"{m['failed_requests']:.0f}",
                 f"{m.get('refused_budget', 0) + m.get('refused_rate_limit', 0):.0f}",
                 f"{m.get('excluded_quota', 0):.2f}", f"{m['preempted']:.0f}", *_migration_cells(m)]
        if prefix:
            cells += _prefix_cells(m)
        t.add_row(*cells)
    Console(width=180).print(t)
    rows = policy_exclusions(results)
    if rows:
        p = Table(title="routing policies: exclusions", caption="offerings each excluded per request (share of "
                                                                  "requests it excluded any)")
        p.add_column("policy", justify="left")
        for name in rows[0][1]:
            p.add_column(name, justify="right")
        for name, pcells in rows:
            p.add_row(name, *pcells.values())
        Console(width=180).print(p)


def policy_exclusions(results: list[PolicyResult]) -> list[tuple[str, dict[str, str]]]:
    """Per evaluated policy, each routing policy's exclusions (``policy_excluded[..]``,
    ``policy_affected[..]`` metrics) as table cells; empty without routing policies."""
    out = []
    for r in results:
        names = [k[len("policy_excluded["):-1] for k in r.metrics if k.startswith("policy_excluded[")]
        if names:
            out.append((r.name, {n: f"{r.metrics[f'policy_excluded[{n}]']:.2f} "
                                    f"({100 * r.metrics[f'policy_affected[{n}]']:.1f} %)" for n in names}))
    return out


def _migration_cells(m: dict[str, float]) -> list[str]:
    """The migration columns: requests moved off preempted pools, tokens recomputed (work lost), KV
    cache moved (GB), requests whose migration missed its notice window."""
    return [f"{m.get('migrations', 0):.0f}", f"{m.get('tokens_recomputed', 0):,.0f}",
            f"{m.get('kv_gb_moved', 0):.3f}", f"{m.get('missed_window', 0):.0f}"]


def _prefix_cells(m: dict[str, float]) -> list[str]:
    """The prefix caches' columns: hit rate (cached prompt tokens / prompt tokens), prefill tokens
    saved, and sessions served on more than one offering ("—" where the stream names none)."""
    moved = m.get("sessions_moved")
    return [f"{100 * m.get('prefix_hit_rate', float('nan')):.1f}", f"{m.get('prefill_tokens_saved', 0.0):,.0f}",
            "—" if moved is None or not math.isfinite(moved) else f"{moved:.0f}"]


def as_results(runs: list[Any]) -> list[PolicyResult]:
    """Single-seed :class:`PolicyRun` s (a training callback's) as :class:`PolicyResult` s, compared
    to the best baseline among them."""
    if all(isinstance(r, PolicyResult) for r in runs):
        return runs
    out = []
    for r in runs:
        if isinstance(r, PolicyResult):
            out.append(r)
            continue
        res = PolicyResult(r.name, [r], is_baseline=is_baseline(r.name))
        res.metrics = dict(r.metrics)
        res.ci = {k: (float("nan"), float("nan")) for k in METRICS}
        out.append(res)
    compare_to_best(out)
    return out


def markdown_table(results: list[Any]) -> str:
    """The comparison as a Markdown table (mean ± half the 95 % interval; Δ = paired difference to
    the best baseline), for docs and MLflow."""
    results = as_results(results)
    best = best_baseline(results)
    prefix = bool(results) and "prefix_hit_rate" in results[0].metrics
    head = ("| policy | reward | Δ reward | $/1k req | p50 ms | p95 ms | TTFT p95 ms | SLO % | Δ SLO pp | failed | "
            "refused | preempted | migrations | tokens recomputed | KV GB moved | missed window |" +
            (" prefix hit % | prefill tokens saved | sessions moved |" if prefix else "") +
            "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" +
            ("---:|---:|---:|" if prefix else "") + "\n")
    rows = []
    for r in results:
        m, ci, vb = r.metrics, r.ci, r.vs_best

        def d(k: str, fmt: str, scale: float = 1.0, vb: dict[str, tuple[float, float, float]] = vb) -> str:
            if k not in vb:
                return "—"
            mean, lo, hi = (x * scale for x in vb[k])
            return _pm(mean, lo, hi, fmt)

        mark = (" (reference)" if r.is_reference else " (best baseline)") if r is best else ""
        rows.append(f"| {r.name}{mark} | {_pm(m['mean_reward'], *ci['mean_reward'], '.4f')} "
                    f"| {d('mean_reward', '+.4f')} | {_pm(m['cost_per_1k_requests'], *ci['cost_per_1k_requests'], '.4f')} "
                    f"| {m['latency_p50_ms']:.0f} | {m['latency_p95_ms']:.0f} | {m['ttft_p95_ms']:.0f} "
                    f"| {100 * m['sla_attainment']:.2f} | {d('sla_attainment', '+.2f', 100.0)} | {m['failed_requests']:.0f} "
                    f"| {m.get('refused_budget', 0) + m.get('refused_rate_limit', 0):.0f} | {m['preempted']:.0f} |"
                    + "".join(f" {c} |" for c in _migration_cells(m))
                    + ("".join(f" {c} |" for c in _prefix_cells(m)) if prefix else ""))
    return head + "\n".join(rows) + "\n"


def results_from_report(report: dict[str, Any]) -> list[PolicyResult]:
    """A saved report (``report_dict``'s JSON) back as results, for tables and plots."""
    out = []
    for name, p in report["policies"].items():
        runs = [PolicyRun(name, dict(m), np.zeros(0), np.zeros(0)) for m in p["per_seed"]]
        res = PolicyResult(name, runs, is_baseline=is_baseline(name))
        res.metrics = {k: (float("nan") if v is None else v) for k, v in p.items() if isinstance(v, (int, float))}
        res.ci = {k: tuple(float("nan") if x is None else x for x in v) for k, v in p["ci95"].items()}  # type: ignore[misc]
        out.append(res)
    compare_to_best(out, report.get("compared_to") if report.get("compared_to") != report.get("best_baseline") else None)
    return out


def plot(results: list[Any], path: str | Path, title: str = "") -> None:
    """Four panels a reader compares: (1) each policy's paired difference in mean reward to the
    best baseline with its 95 % interval (off-scale policies drawn at the edge with their value);
    (2) cost vs p95 latency with intervals, zoomed on the policies within reach of the best
    baseline and labelled through a legend (no overlapping labels); (3) SLO misses and failed
    requests per policy; (4) cumulative cost difference to the best baseline over time (first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = as_results(results)
    best = best_baseline(results)
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    ax1, ax2, ax3, ax4 = axes.ravel()
    colors = plt.get_cmap("tab10")
    color = {r.name: colors(i % 10) for i, r in enumerate(results)}

    # (1) forest plot of paired reward differences
    rows = sorted(results, key=lambda r: r.vs_best.get("mean_reward", (r.metrics["mean_reward"],))[0])
    diffs = [r.vs_best.get("mean_reward", (0.0, np.nan, np.nan)) for r in rows]
    near = [m for m, _, _ in diffs if abs(m) <= 0.05 + 1e-12]
    span = max([abs(x) for x in near] + [1e-4]) * 1.6
    for y, (r, (m, lo, hi)) in enumerate(zip(rows, diffs)):
        if abs(m) > span:
            edge = -span if m < 0 else span
            ax1.plot([edge], [y], marker="<" if m < 0 else ">", color=color[r.name], markersize=10)
            ax1.annotate(f"{m:+.3f}", (edge, y), textcoords="offset points", xytext=(8 if m < 0 else -40, -12),
                         fontsize=8)
        else:
            err = None if not math.isfinite(lo) else [[m - lo], [hi - m]]
            ax1.errorbar([m], [y], xerr=err, fmt="o", color=color[r.name], capsize=4)
    ax1.axvline(0.0, color="0.3", lw=1)
    ax1.set_yticks(range(len(rows)), [r.name for r in rows], fontsize=8)
    ax1.set_xlim(-span * 1.05, span * 1.05)
    ax1.set_xlabel(f"mean reward − {best.name if best else 'best baseline'} (paired by seed, 95 % CI)")
    ax1.set_title("reward difference to the best baseline (right is better)")
    ax1.grid(alpha=0.3, axis="x")

    # (2) cost vs p95, zoomed on the policies near the best baseline
    ref_cost = best.metrics["cost_per_1k_requests"] if best else 1.0
    ref_p95 = best.metrics["latency_p95_ms"] if best else 1.0
    zoom = [r for r in results if r.metrics["cost_per_1k_requests"] <= 3 * ref_cost
            and r.metrics["latency_p95_ms"] <= 3 * ref_p95]
    off = [r.name for r in results if r not in zoom]
    markers = "osD^v<>PX*"
    for i, r in enumerate(zoom):
        mt, ci = r.metrics, r.ci
        xe = None if not math.isfinite(ci["latency_p95_ms"][0]) else \
            [[mt["latency_p95_ms"] - ci["latency_p95_ms"][0]], [ci["latency_p95_ms"][1] - mt["latency_p95_ms"]]]
        ye = None if not math.isfinite(ci["cost_per_1k_requests"][0]) else \
            [[mt["cost_per_1k_requests"] - ci["cost_per_1k_requests"][0]],
             [ci["cost_per_1k_requests"][1] - mt["cost_per_1k_requests"]]]
        ax2.errorbar([mt["latency_p95_ms"]], [mt["cost_per_1k_requests"]], xerr=xe, yerr=ye, fmt=markers[i % 10],
                     color=color[r.name], markersize=9 - 0.4 * i, alpha=0.85, capsize=3, label=r.name)
    ax2.set_xlabel("p95 latency (ms)")
    ax2.set_ylabel("cost per 1k requests (USD)")
    ax2.set_title("cost vs p95 latency (lower-left is better)" + (f"\nnot shown (>3x the best baseline): "
                                                                   f"{', '.join(off)}" if off else ""), fontsize=10)
    ax2.legend(fontsize=8, loc="best")
    ax2.grid(alpha=0.3)

    # (3) SLO misses and failures
    names = [r.name for r in results]
    n_req = [max(r.metrics["requests"], 1) for r in results]
    miss = [100 * (1 - r.metrics["sla_attainment"]) for r in results]
    fail = [100 * r.metrics["failed_requests"] / q for r, q in zip(results, n_req)]
    x = np.arange(len(results))
    ax3.bar(x - 0.2, miss, 0.4, label="SLO missed (%)", color="tab:orange")
    ax3.bar(x + 0.2, fail, 0.4, label="failed (%)", color="tab:red")
    ax3.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax3.set_yscale("symlog", linthresh=0.1)
    ax3.set_ylabel("% of requests (symlog)")
    ax3.set_title("SLO misses and failed requests")
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3, axis="y")

    # (4) cumulative cost difference to the best baseline
    if best is not None:
        for r in zoom:
            if r is best or len(r.cum_cost) != len(best.cum_cost):
                continue
            ax4.plot((r.t - r.t[0]) / 60.0, r.cum_cost - best.cum_cost, label=r.name, color=color[r.name])
        ax4.axhline(0.0, color="0.3", lw=1)
        ax4.set_xlabel("minutes into the stream")
        ax4.set_ylabel(f"cumulative cost − {best.name} (USD)")
        ax4.set_title("where the cost differences accrue (first seed)")
        ax4.legend(fontsize=8)
        ax4.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(data: dict[str, Any], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float))
    tmp.replace(p)


def default_report_path(now: float | None = None) -> Path:
    """``reports/evaluate-<UTC time>.json``: a run never overwrites another's report."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    p = Path("reports") / f"evaluate-{stamp}.json"
    k = 1
    while p.exists():
        k += 1
        p = Path("reports") / f"evaluate-{stamp}-{k}.json"
    return p


def sample_rows(n: int, size: int, blocks: int = 8) -> np.ndarray:
    """Positions of ``size`` requests out of ``n`` in ``blocks`` evenly spaced contiguous blocks
    (a quick look that keeps the queueing within each block)."""
    if size >= n:
        return np.arange(n)
    blocks = max(1, min(blocks, size))
    per = size // blocks
    starts = np.linspace(0, n - per, blocks).astype(int)
    rows = np.unique(np.concatenate([np.arange(s, s + per) for s in starts]))
    return rows
