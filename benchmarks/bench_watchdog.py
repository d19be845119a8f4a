"""The champion's watchdog (``router.decision.watchdog``; docs/ope.md, "The watchdog"): how many
decisions it takes to trip on a champion worse than greedy, and how often it trips on one that is
not (false alarms), over replays of the shipped bundle.

Each replay is a window of the shipped bundle's request stream (``--replays`` windows, each
starting ``--stride`` requests after the previous, each with its own noise seed) routed on-policy
by the champion in the simulator -- the environment with the router's own config
(``router.decision.engine.env_config``) -- with every decision fed to the router's estimator
(``WatchdogEstimator``, the router's settings) exactly as the router feeds it: the prior of the
champion's, greedy's and the served offering from the decision's rows (``RewardPrior``), greedy's
choice the argmax of the expected rewards plus the policies' bias over the valid offerings (the
router's ``watchdog`` stage), the realized reward of the step (the simulator's one definition).
Three estimators are fed the same decisions side by side: ``before`` (greedy's side judged in
the champion's state, the watchdog before its twin, with its old verdict: a fixed-level normal
interval over a sliding window read after every term), ``twin`` (greedy's side in greedy's twin,
``envs.twin``, kept beside the simulation's router view exactly as the router keeps it, the same
old verdict) and ``cs`` (the twin with the router's verdict now: the confidence sequence over every
term, ``WatchdogEstimator``). A false alarm is a trip in a replay where the champion was not worse
than greedy on-policy by more than the margin.
The truth beside it: greedy routing the same window with the same seed, on-policy; the table's
"true diff" is the champion's mean reward minus greedy's over the same requests. And what the
estimator estimates: the hindsight difference in the states the champion's routing left
(``CloudRouteEnv.exact_rewards``: what greedy's choice would really have got there), over the
decisions up to the trip (all when none) -- the two differ by congestion (docs/ope.md, "Limits").

Champions (exported weights, ``models.policy.RouterWeights``, as ``xroute train`` exports them):
``priciest`` (the highest expected cost), ``pricey`` and ``pricier`` (the reward prior plus a weight on expected
cost: pays for faster pools), ``greedy`` (the prior alone: greedy's choice) and ``near-greedy``
(the prior plus a small weight against expected latency).

Usage::

    .venv/bin/python benchmarks/bench_watchdog.py                 # ~2 min on 2 shared cores
    .venv/bin/python benchmarks/bench_watchdog.py --replays 5 --decisions 1000   # quicker
    .venv/bin/python benchmarks/bench_watchdog.py --families '' --export champion=runs/trials/<stamp>/<trial>/router

``--window`` is the old verdict's sliding window (``before`` and ``twin``; 1,000, what the router had),
``--horizon`` the confidence sequence's (``cs``; the router's default).

Writes ``benchmarks/results/watchdog.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from envs import kernels as env_kernels  # noqa: E402
from envs.cloud_route import CloudRouteEnv  # noqa: E402
from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES, OFFERING_FEATURES  # noqa: E402
from envs.twin import GreedyTwin  # noqa: E402
from models.policy import LearnedPolicy, RewardPrior, RouterWeights, read_router  # noqa: E402
from router.core.settings import RouterSettings, WatchdogSettings  # noqa: E402
from router.decision.engine import env_config  # noqa: E402
from router.decision.watchdog import WatchdogEstimator, normal_interval  # noqa: E402
from xroute.bundle import load_bundle  # noqa: E402

SHIPPED = REPO / "data" / "bundles" / "default"
#: the estimators fed side by side: greedy's side in the champion's state (the watchdog before its
#: twin), in greedy's twin's state (``envs.twin``), both with the old verdict (a fixed-level interval
#: over a sliding window: ``FixedIntervalEstimator``), and the twin with the router's verdict now (the
#: confidence sequence: ``WatchdogEstimator``)
ESTIMATORS = ("before", "twin", "cs")
#: those fed greedy's twin figure
TWINNED = ("twin", "cs")
#: the old verdict's sliding window (what the router had: ``watchdog.window``, 1,000)
WINDOW = 1000


class FixedIntervalEstimator(WatchdogEstimator):
    """The watchdog's verdict before its confidence sequence, for the comparison: the fixed-level
    normal interval (``normal_interval``) over the last ``window`` terms, read after every term."""

    def __init__(self, window: int, min_decisions: int, confidence: float, margin: float):
        self.window = window
        super().__init__(window, min_decisions, confidence, margin)

    def reset(self) -> None:
        super().reset()
        self.terms: deque[float] = deque(maxlen=self.window)

    def add(self, d: float) -> None:
        self.terms.append(d)
        self.n = len(self.terms)
        if self.n >= 2:
            self.estimate = normal_interval(np.fromiter(self.terms, float, self.n), self.confidence)


def estimators(cfg: WatchdogSettings, window: int = WINDOW) -> dict[str, WatchdogEstimator]:
    """The three estimators of one replay (``ESTIMATORS``), with ``cfg``'s settings."""
    old = {k: FixedIntervalEstimator(window, cfg.min_decisions, cfg.confidence, cfg.margin) for k in ("before", "twin")}
    return {**old, "cs": WatchdogEstimator(cfg.horizon, cfg.min_decisions, cfg.confidence, cfg.margin)}
#: CPU time (ns) of greedy's choice in the real state and of the twin's step, over the decisions fed
CPU_NS = {"greedy": 0, "twin": 0, "n": 0}
#: champion -> (weight on exp_cost, weight on exp_latency, whether the reward prior is added)
FAMILIES: dict[str, tuple[float, float, bool]] = {
    "priciest": (1.0, 0.0, False),
    "pricey": (0.5, 0.0, True),
    "pricier": (0.05, 0.0, True),
    "greedy": (0.0, 0.0, True),
    "near-greedy": (0.0, -0.002, True),
}


def champion(name: str, prior: RewardPrior) -> LearnedPolicy:
    w_cost, w_lat, with_prior = FAMILIES[name]
    w = np.zeros((N_OFFERING_FEATURES + N_REQUEST_FEATURES, 1), dtype=np.float32)
    w[OFFERING_FEATURES.index("exp_cost"), 0] = w_cost
    w[OFFERING_FEATURES.index("exp_latency"), 0] = w_lat
    # (a linear score through one ReLU unit needs a non-negative sum: the prior carries the sign)
    layers = [(w, np.full(1, 10.0 if w_lat < 0 else 0.0, dtype=np.float32)), (np.ones((1, 1), dtype=np.float32),
                                                                              np.zeros(1, dtype=np.float32))]
    return LearnedPolicy(RouterWeights(layers, prior=prior if with_prior else None), name=name)


def greedy_choice(env: CloudRouteEnv, mask: np.ndarray) -> int:
    r = env.expected_rewards()
    bias = getattr(env, "r_bias", None)
    if bias is not None and getattr(env, "r_has_bias", False):
        r = r + bias
    return int(env_kernels.rank(r, mask, 0)[0])


def replay(env: CloudRouteEnv, policy: LearnedPolicy | None, start: int, seed: int, n: int,
           ests: dict[str, WatchdogEstimator], prior: RewardPrior
           ) -> tuple[list[float], dict[str, int | None], list[float]]:
    """``n`` decisions from request ``start`` (``policy`` None: greedy): the rewards, the decision
    at which each of ``ests`` tripped (None: never), and each decision's hindsight difference champion -
    greedy *in the state the champion's routing left* (``CloudRouteEnv.exact_rewards``: what greedy's
    choice would really have got there; 0 where they agree) -- what the estimator without the twin
    estimates. ``ests``: ``before`` (greedy in the champion's state) and ``twin`` (greedy in its
    twin's state, ``envs.twin``: the router's watchdog now), fed the same decisions side by side."""
    obs, info = env.reset(seed=seed, options={"start": start})
    if policy is not None:
        policy.reset(env, seed)
    env.completion_listener = None  # (a previous replay's twin listens no more)
    twin = GreedyTwin(env) if ests else None
    rewards: list[float] = []
    hind: list[float] = []
    tripped: dict[str, int | None] = {k: None for k in ests}
    cpu = CPU_NS
    for i in range(n):
        mask = np.asarray(info["action_mask"][: env.n], dtype=bool)
        c0 = time.process_time_ns()
        g = greedy_choice(env, mask)
        cpu["greedy"] += time.process_time_ns() - c0
        a = g if policy is None else int(policy.act(obs, info))
        if twin is None:
            obs, r, _, trunc, info = env.step(a)
            rewards.append(float(r))
            if trunc:
                break
            continue
        hind.append(0.0 if a == g else float(env.exact_rewards()[a] - env.exact_rewards()[g]))
        bias = env.r_bias if getattr(env, "r_has_bias", False) else None
        ref = env._pos  # (the stream request's position: what its completion names)
        c0 = time.process_time_ns()
        delta = twin.step(ref, mask, g, bias)[1]
        cpu["twin"] += time.process_time_ns() - c0
        cpu["n"] += 1
        failed = env.stats["failed"]
        idx = np.flatnonzero(mask)
        rows = np.asarray(obs["offerings"], dtype=np.float32).reshape(-1, N_OFFERING_FEATURES)[idx]
        p = prior.scores(rows[None], np.asarray(obs["request"])[None])[0]
        pos = {int(k): j for j, k in enumerate(idx)}
        obs, r, _, trunc, info = env.step(a)
        if env.stats["failed"] == failed:  # (admitted: its view holds it until it is seen complete)
            twin.admitted(ref)
        for name, est in ests.items():
            if tripped[name] is None and est.observe(float(p[pos[a]]), float(p[pos[g]]), float(p[pos[a]]), True,
                                                     a == g, 1.0, float(r), delta if name in TWINNED else 0.0):
                tripped[name] = i + 1
        rewards.append(float(r))
        if trunc:
            break
    return rewards, tripped, hind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--decisions", type=int, default=2000, help="decisions per replay")
    ap.add_argument("--stride", type=int, default=1200, help="requests between the replays' starts")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--window", type=int, default=WINDOW, help="the old verdict's sliding window (before, twin)")
    ap.add_argument("--horizon", type=int, default=None, help="the confidence sequence's horizon (default: the router's)")
    ap.add_argument("--min-decisions", type=int, default=None)
    ap.add_argument("--confidence", type=float, default=None)
    ap.add_argument("--margin", type=float, default=None)
    ap.add_argument("--export", action="append", default=[], metavar="NAME=DIR",
                    help="also a trained router's export (xroute train's <trial>/router), named NAME; repeatable")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "watchdog.json")
    a = ap.parse_args()
    cfg = WatchdogSettings(**{k: v for k, v in (("horizon", a.horizon), ("min_decisions", a.min_decisions),
                                                ("confidence", a.confidence), ("margin", a.margin)) if v is not None})
    settings = RouterSettings(telemetry=SHIPPED, model_uri="")
    env_cfg = env_config(settings)
    env = CloudRouteEnv(load_bundle(SHIPPED), env_cfg, all_models=True)
    prior = RewardPrior.from_env_config(env_cfg)
    t0 = time.time()
    greedy_runs = {k: replay(env, None, k * a.stride, k, a.decisions, {}, prior)[0] for k in range(a.replays)}
    rows: list[dict[str, Any]] = []
    exports = dict(e.split("=", 1) for e in a.export)
    for fam in [f for f in a.families.split(",") if f] + list(exports):
        pol = LearnedPolicy(read_router(exports[fam]), name=fam) if fam in exports else champion(fam, prior)
        runs = []
        for k in range(a.replays):
            ests = estimators(cfg, a.window)
            rew, tripped, hind = replay(env, pol, k * a.stride, k, a.decisions, ests, prior)
            base = greedy_runs[k][: len(rew)]
            run: dict[str, Any] = {"start": k * a.stride, "seed": k, "true_diff": float(np.mean(rew) - np.mean(base))}
            for name, est in ests.items():
                at = tripped[name] or len(rew)
                run[name] = {"tripped_at": tripped[name], "true_diff_to_trip": float(np.mean(rew[:at]) - np.mean(base[:at])),
                             "hindsight_diff_to_trip": float(np.mean(hind[:at])),
                             "estimate_at_end": None if est.estimate is None else est.estimate[0]}
            runs.append(run)
        diffs = np.array([r["true_diff"] for r in runs])
        row: dict[str, Any] = {"champion": fam, "replays": a.replays, "true_diff_median": float(np.median(diffs)),
                               "true_diff_min": float(diffs.min()), "true_diff_max": float(diffs.max()),
                               "worse_in": int((diffs < 0).sum()), "runs": runs}
        for name in ESTIMATORS:
            trips = [r[name]["tripped_at"] for r in runs if r[name]["tripped_at"] is not None]
            # a false alarm: tripped where the champion was not worse on-policy (true diff above -margin)
            row[name] = {"hindsight_diff_median": float(np.median([r[name]["hindsight_diff_to_trip"] for r in runs])),
                         "estimate_median": float(np.median([r[name]["estimate_at_end"] or 0.0 for r in runs])),
                         "tripped": len(trips),
                         "false_alarms": sum(1 for r in runs if r[name]["tripped_at"] is not None
                                             and r["true_diff"] >= -cfg.margin),
                         "not_worse": sum(1 for r in runs if r["true_diff"] >= -cfg.margin),
                         "delay_median": None if not trips else float(np.median(trips)),
                         "delay_max": None if not trips else int(max(trips))}
        rows.append(row)
    out = {"command": "python benchmarks/bench_watchdog.py " + " ".join(sys.argv[1:]), "nproc": os.cpu_count(),
           "python": platform.python_version(), "bundle": "shipped (data/bundles/default)",
           "watchdog": cfg.model_dump(), "old_window": a.window, "decisions": a.decisions, "stride": a.stride,
           "seconds": round(time.time() - t0, 1), "families": rows}
    cpu = CPU_NS
    if cpu["n"]:
        # what the twin adds per decision, beside what greedy's choice costs already (CPU time, this process)
        out["cpu_us_per_decision"] = {"greedy_choice": cpu["greedy"] / cpu["n"] / 1e3, "twin_step": cpu["twin"] / cpu["n"] / 1e3,
                                      "decisions": cpu["n"]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"watchdog: horizon {cfg.horizon} (cs), window {a.window} (before, twin), min_decisions {cfg.min_decisions}, confidence {cfg.confidence}, margin "
          f"{cfg.margin}; {a.replays} replays x {a.decisions} decisions of the shipped bundle; nproc {os.cpu_count()}")
    print("| champion | true diff to greedy, median [min, max] | replays where worse | estimator | tripped "
          "| false alarms (tripped where not worse) | decisions to trip, median (max) | estimate at trip/end, median |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name in ESTIMATORS:
            x = r[name]
            delay = "-" if x["delay_median"] is None else f"{x['delay_median']:.0f} ({x['delay_max']})"
            print(f"| {r['champion']} | {r['true_diff_median']:+.5f} [{r['true_diff_min']:+.5f}, "
                  f"{r['true_diff_max']:+.5f}] | {r['worse_in']}/{r['replays']} | {name} | {x['tripped']}/{r['replays']} "
                  f"| {x['false_alarms']}/{x['not_worse']} | {delay} | {x['estimate_median']:+.5f} |")
    if "cpu_us_per_decision" in out:
        c = out["cpu_us_per_decision"]
        print(f"CPU per decision: greedy's choice {c['greedy_choice']:.1f} us, the twin's step {c['twin_step']:.1f} us "
              f"(mean over {c['decisions']} decisions)")
    print(f"({out['seconds']} s) -> {a.out}")


if __name__ == "__main__":
    main()
