"""``xroute evaluate`` throughput: requests per second per policy, the oracle included.

Two streams, one seed each, every policy run back to back in one process (so ratios within a run
compare like with like on a shared machine):

* ``shipped``: the shipped bundle (28,185 requests, one real hour), or ``--requests`` of it;
* ``long``: a ~100k-request, 8-day stream for the scaling question: the shipped hour's real
  requests tiled at 0, 2, 4, 6 days (and half of it at 7.5) over the shipped catalog and telemetry.
  It measures speed only (the tiling repeats the same hour; it is not a realistic week).

The oracle plans with a lookahead (``EvaluateConfig.oracle``: ``top_k`` offerings played
``horizon`` requests ahead); before issue 26 only on streams up to 30,000 requests, so on the long
stream it planned with hindsight-greedy and the baselines alone (``oracle[no lookahead]``); since,
on whole streams (``benchmarks/bench_oracle.py`` times that case, 100,000 requests with all eight
policies). ``--oracle-window`` also times the oracle on that many requests of the long stream.

    .venv/bin/python benchmarks/bench_evaluate.py [--requests N] [--long-requests N] [--oracle-window 12000]

Prints a table and writes ``benchmarks/results/evaluate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from envs.cloud_route import CloudRouteEnv
from models import evaluate as ev
from xroute.bundle import DEFAULT_BUNDLE, Bundle, load_bundle
from xroute.config import EvaluateConfig

POLICIES = ("static", "cheapest", "lowest-latency", "least-loaded", "greedy", "round-robin", "random")


def long_bundle(root: Path, target: int) -> Bundle:
    """The shipped bundle with its hour of requests tiled over 8 days (ids made unique)."""
    import shutil

    for f in DEFAULT_BUNDLE.iterdir():
        if f.is_file() and f.name != "workload.csv.gz":
            shutil.copy2(f, root / f.name)
    w = pd.read_csv(DEFAULT_BUNDLE / "workload.csv.gz", dtype=str, keep_default_na=False)
    ts = pd.to_datetime(w["ts"], utc=True, format="ISO8601")
    parts, offsets = [], [0.0, 2.0, 4.0, 6.0, 7.5]
    total = 0
    for k, days in enumerate(offsets):
        part = w.copy()
        part["ts"] = (ts + pd.Timedelta(days=days)).dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        part["request_id"] = part["request_id"] + f"-{k}"
        take = min(len(part), target - total)
        parts.append(part.iloc[:take])
        total += take
        if total >= target:
            break
    pd.concat(parts, ignore_index=True).to_csv(root / "workload.csv.gz", index=False)
    return load_bundle(root)


def learned_policy_dir(root: Path) -> str:
    """A router export of the champion's shape (random weights): the learned policy's cost."""
    import itertools

    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
    from models.policy import RewardPrior, RouterWeights, save_router

    rng = np.random.default_rng(0)
    ctx = 16
    dims = [N_OFFERING_FEATURES + N_REQUEST_FEATURES + ctx, 64, 64, 1]
    layers = [(rng.normal(0, 0.1, (a, b)).astype(np.float32), np.zeros(b, np.float32)) for a, b in itertools.pairwise(dims)]
    c = (rng.normal(0, 0.1, (N_OFFERING_FEATURES + N_REQUEST_FEATURES, ctx)).astype(np.float32), np.zeros(ctx, np.float32))
    w = RouterWeights(layers=layers, ctx=c, prior=RewardPrior.from_env_config(EvaluateConfig().env))
    return str(save_router(w, root / "learned"))


def time_policies(bundle: Bundle, names: list[str], cfg: EvaluateConfig, label: str) -> list[dict[str, object]]:
    rows = []
    for name in names:
        t0 = time.perf_counter()
        res = ev.evaluate(bundle, [name], cfg, show_progress=False, seeds=1)[0]
        wall = time.perf_counter() - t0
        n = len(bundle.workload)
        rows.append({"stream": label, "policy": res.name if not name.startswith("/") else "learned (DQN shape)",
                     "requests": n, "wall_s": round(wall, 2), "requests_per_s": round(n / wall, 1),
                     "mean_reward": round(res.metrics["mean_reward"], 5)})
        print(f"  {label:8s} {rows[-1]['policy']:22s} {n:>7,} req  {wall:7.1f} s  {n / wall:9,.0f} req/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="requests of the shipped stream (default: all)")
    ap.add_argument("--long-requests", type=int, default=100_000)
    ap.add_argument("--oracle-window", type=int, default=12_000, help="requests the lookahead oracle is timed on")
    ap.add_argument("--out", default="benchmarks/results/evaluate.json")
    args = ap.parse_args()
    for flag, v in (("--requests", args.requests), ("--long-requests", args.long_requests),
                    ("--oracle-window", args.oracle_window)):
        if v is not None and v < 100:
            ap.error(f"{flag} must be at least 100 (got {v})")
    cfg = EvaluateConfig()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        learned = learned_policy_dir(tmp_p)
        shipped = load_bundle()
        if args.requests:
            shipped = shipped.select(np.arange(min(args.requests, len(shipped.workload))))
        print(f"shipped stream: {len(shipped.workload):,} requests")
        rows += time_policies(shipped, [*POLICIES, learned, "oracle"], cfg, "shipped")
        (tmp_p / "long").mkdir()
        long = long_bundle(tmp_p / "long", args.long_requests)
        span = long.time_span()
        print(f"long stream: {len(long.workload):,} requests, {span[0]:%Y-%m-%d} .. {span[1]:%Y-%m-%d}")
        t0 = time.perf_counter()
        CloudRouteEnv(long, cfg.env)
        build_s = time.perf_counter() - t0
        rows += time_policies(long, ["static", "greedy", learned, "oracle"], cfg, "long")
        window = long.select(np.arange(min(args.oracle_window, len(long.workload))))
        rows += time_policies(window, ["greedy", "oracle"], cfg, "long[:w]")
    by = {(r["stream"], r["policy"]): r for r in rows}
    for r in rows:
        g = by.get((r["stream"], "greedy"))
        r["time_vs_greedy"] = round(float(g["requests_per_s"]) / float(r["requests_per_s"]), 2) if g else None
    print()
    print(f"{'stream':9s} {'policy':24s} {'requests':>9s} {'wall s':>8s} {'req/s':>9s} {'x greedy time':>13s}")
    for r in rows:
        print(f"{r['stream']:9s} {r['policy']:24s} {r['requests']:>9,} {r['wall_s']:>8.1f} {r['requests_per_s']:>9,.0f} "
              f"{r['time_vs_greedy'] if r['time_vs_greedy'] is not None else '':>13}")
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "env_build_s_long": round(build_s, 2), "oracle": cfg.oracle.model_dump(), "rows": rows,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
