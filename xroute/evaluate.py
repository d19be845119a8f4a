"""Replay one request stream through several policies and compare them (``xroute evaluate``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.cloud_route import CloudRouteEnv
from models.baselines import Policy, make_baseline
from xroute.bundle import Bundle
from xroute.config import EvaluateConfig

METRICS = ("requests", "cost_usd", "cost_per_1k_requests", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
           "sla_attainment", "failed_requests", "migrations", "mean_reward")


@dataclass
class PolicyRun:
    name: str
    metrics: dict[str, float]
    t: np.ndarray = field(repr=False)
    cum_cost: np.ndarray = field(repr=False)


def resolve_policy(name: str, cfg: EvaluateConfig) -> Policy:
    """A baseline name, ``static:OFFERING_ID``, or a learned policy (``models:/NAME@ALIAS`` or a path)."""
    if name.startswith("models:/") or name.startswith("runs:/") or Path(name).exists():
        from models.policy import load_policy  # the learned router; imports torch-free numpy code only

        return load_policy(name)
    return make_baseline(name, cfg)


def run_policy(env: CloudRouteEnv, policy: Policy, seed: int,
               progress: Callable[[int], None] | None = None) -> PolicyRun:
    obs, info = env.reset(seed=seed)
    policy.reset(env, seed)
    n = env._end - env._pos
    rewards = np.empty(n)
    costs = np.empty(n)
    lats = np.empty(n)
    viol = np.empty(n, dtype=bool)
    ts = np.empty(n)
    failed = migrations = 0
    for k in range(n):
        ts[k] = info["t"]
        a = policy.act(obs, info)
        obs, r, _term, trunc, info = env.step(a)
        rewards[k], costs[k], lats[k], viol[k] = r, info["cost_usd"], info["latency_ms"], info["sla_violation"]
        failed += bool(info["failed"])
        migrations += info["migrated_to"] is not None
        if progress is not None and (k % 500 == 499 or trunc):
            progress(k % 500 + 1)
    served = lats[~np.isnan(lats)]
    p50, p95, p99 = (np.percentile(served, [50, 95, 99]) if served.size else (np.nan,) * 3)
    total = float(costs.sum())
    m = {
        "requests": n, "cost_usd": round(total, 6), "cost_per_1k_requests": round(1000.0 * total / n, 6),
        "latency_p50_ms": round(float(p50), 2), "latency_p95_ms": round(float(p95), 2),
        "latency_p99_ms": round(float(p99), 2), "sla_attainment": round(float(1.0 - viol.mean()), 6),
        "failed_requests": int(failed), "migrations": int(migrations), "mean_reward": round(float(rewards.mean()), 6),
    }
    return PolicyRun(policy.name if not hasattr(policy, "display_name") else policy.display_name, m, ts, np.cumsum(costs))


def evaluate(bundle: Bundle, policies: list[str], cfg: EvaluateConfig, show_progress: bool = True) -> list[PolicyRun]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    env = CloudRouteEnv(bundle, cfg.env)
    resolved = [(p, resolve_policy(p, cfg)) for p in policies]
    runs = []
    with Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show_progress, transient=False) as bar:
        for label, pol in resolved:
            task = bar.add_task(label, total=env.n_requests if cfg.env.episode_requests is None else cfg.env.episode_requests)
            t0 = time.perf_counter()
            def advance(k: int, task: Any = task) -> None:
                bar.advance(task, k)

            if hasattr(pol, "on_progress"):  # the oracle plans the whole stream first: show it
                def planning(name: str, p: int, n: int, done: int, total: int, task: Any = task,
                             label: str = label) -> None:
                    bar.update(task, description=f"{label} (plan {p}/{n} {name}: {100 * done // max(total, 1)}%)")

                pol.on_progress = planning

            run = run_policy(env, pol, cfg.seed, progress=advance)
            bar.update(task, description=label)
            run.name = label
            run.metrics["wall_s"] = round(time.perf_counter() - t0, 2)
            runs.append(run)
    return runs


def report_dict(runs: list[PolicyRun], bundle: Bundle, cfg: EvaluateConfig, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "bundle": str(bundle.path), "bundle_hash": bundle.content_hash, "seed": cfg.seed,
        "rate_scale": cfg.env.rate_scale, **extra,
        "policies": {r.name: r.metrics for r in runs},
    }


def print_table(runs: list[PolicyRun], title: str = "xroute evaluate") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = [("policy", "l"), ("$/1k req", "r"), ("cost $", "r"), ("p50 ms", "r"), ("p95 ms", "r"),
            ("p99 ms", "r"), ("SLA %", "r"), ("failed", "r"), ("migr.", "r"), ("reward", "r")]
    for c, j in cols:
        t.add_column(c, justify="left" if j == "l" else "right")
    best = max(r.metrics["mean_reward"] for r in runs)
    for r in runs:
        m = r.metrics
        t.add_row(r.name + (" *" if m["mean_reward"] == best else ""), f"{m['cost_per_1k_requests']:.4f}",
                  f"{m['cost_usd']:.2f}", f"{m['latency_p50_ms']:.0f}", f"{m['latency_p95_ms']:.0f}",
                  f"{m['latency_p99_ms']:.0f}", f"{100 * m['sla_attainment']:.2f}", str(m["failed_requests"]),
                  str(m["migrations"]), f"{m['mean_reward']:.4f}")
    Console(width=140).print(t)


def plot(runs: list[PolicyRun], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for r in runs:
        ax1.scatter(r.metrics["latency_p95_ms"], r.metrics["cost_per_1k_requests"], s=60)
        ax1.annotate(r.name, (r.metrics["latency_p95_ms"], r.metrics["cost_per_1k_requests"]),
                     textcoords="offset points", xytext=(5, 4), fontsize=8)
        minutes = (r.t - r.t[0]) / 60.0
        ax2.plot(minutes, r.cum_cost, label=r.name)
    ax1.set_xlabel("p95 latency (ms)")
    ax1.set_ylabel("cost per 1k requests (USD, log scale)")
    ax1.set_yscale("log")
    ax1.set_title("cost vs p95 latency (lower-left is better)")
    ax1.grid(alpha=0.3)
    ax2.set_xlabel("minutes into the stream")
    ax2.set_ylabel("cumulative cost (USD)")
    ax2.set_title("cumulative cost over time")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
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
