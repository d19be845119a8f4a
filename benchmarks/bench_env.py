"""Environment throughput at 10, 100 and 1,000 offerings (one core, one process).

Catalogs are the shipped bundle's offerings cycled to the target size (``resize_catalog``); the
request stream is the shipped one. The action is the first valid offering (a near-free policy),
so the figure is the environment's own cost per step. Reports the median of several timed
rounds, and the machine's core count.

    .venv/bin/python benchmarks/bench_env.py [--steps 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from envs.cloud_route import CloudRouteEnv
from xroute.bundle import load_bundle
from xroute.catalog_tools import resize_catalog


def measure(env: CloudRouteEnv, steps: int) -> float:
    obs, info = env.reset(seed=0)
    done = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        a = int(np.argmax(info["action_mask"]))
        obs, _, _, trunc, info = env.step(a)
        done += 1
        if trunc:
            obs, info = env.reset()
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--out", default="benchmarks/results/env.json")
    args = ap.parse_args()
    base = load_bundle()
    rows = []
    for n in args.sizes:
        env = CloudRouteEnv(resize_catalog(base, n), max_offerings=n, episode_requests=4096)
        measure(env, 500)  # warm-up
        rates = [measure(env, args.steps) for _ in range(args.rounds)]
        rows.append({"offerings": n, "median_steps_per_s": round(statistics.median(rates)),
                     "min": round(min(rates)), "max": round(max(rates)), "us_per_step": round(1e6 / statistics.median(rates), 1)})
    meta = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "steps_per_round": args.steps, "rounds": args.rounds, "target": ">= 20,000 steps/s at 100 offerings"}
    print(f"env throughput, {meta['cpu_count']} cores, median of {args.rounds} x {args.steps} steps")
    print(f"{'offerings':>10} {'steps/s':>10} {'us/step':>9} {'min':>9} {'max':>9}")
    for r in rows:
        print(f"{r['offerings']:>10} {r['median_steps_per_s']:>10} {r['us_per_step']:>9} {r['min']:>9} {r['max']:>9}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
