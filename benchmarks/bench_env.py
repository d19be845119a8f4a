"""Environment throughput at 10, 100 and 1,000 offerings (one core, one process).

Catalogs are the shipped bundle's offerings cycled to the target size (``resize_catalog``); the
request stream is the shipped one. The action is the first valid offering (a near-free policy),
so the figure is the environment's own cost per step. Reports the median of several timed
rounds, and the machine's core count.

    .venv/bin/python benchmarks/bench_env.py [--steps 20000] [--rounds 5]

Side by side with another checkout of the project (a change's cost against its base):

    .venv/bin/python benchmarks/bench_env.py --against /path/to/base --steps 5000 --rounds 7

runs the rounds alternately in this tree and in the other one (one process per round, each importing
its own tree's code), and prints both medians and their ratio per catalog size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from envs.cloud_route import CloudRouteEnv
from xroute.bundle import load_bundle
from xroute.catalog_tools import resize_catalog


def measure(env: CloudRouteEnv, steps: int, clock: str = "wall") -> float:
    now = time.process_time if clock == "cpu" else time.perf_counter
    obs, info = env.reset(seed=0)
    done = 0
    t0 = now()
    for _ in range(steps):
        a = int(np.argmax(info["action_mask"]))
        obs, _, _, trunc, info = env.step(a)
        done += 1
        if trunc:
            obs, info = env.reset()
    return done / (now() - t0)


def _one_round(tree: Path, args: argparse.Namespace) -> dict[int, float]:
    """One round of this benchmark (this file, the same measuring code) run on ``tree``'s code:
    steps/s per catalog size."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "env.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps), "--rounds", "1",
                        "--sizes", *map(str, args.sizes), "--out", str(out), *(["--clock", "cpu"] if args.clock == "cpu" else [])], cwd=tree, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return {r["offerings"]: r["median_steps_per_s"] for r in json.loads(out.read_text())["results"]}


def against(args: argparse.Namespace) -> None:
    """Alternate rounds in this tree and in ``args.against``; print medians and this/that ratios."""
    here, there = Path(__file__).resolve().parents[1], Path(args.against).resolve()
    got: dict[str, list[dict[int, float]]] = {"this": [], "base": []}
    for _ in range(args.rounds):
        got["base"].append(_one_round(there, args))
        got["this"].append(_one_round(here, args))
    rows = []
    for n in args.sizes:
        a = statistics.median(r[n] for r in got["this"])
        b = statistics.median(r[n] for r in got["base"])
        rows.append({"offerings": n, "this_steps_per_s": round(a), "base_steps_per_s": round(b),
                     "ratio": round(a / b, 3)})
    meta = {"cpu_count": os.cpu_count(), "this": str(here), "base": str(there), "steps_per_round": args.steps,
            "rounds": args.rounds, "clock": args.clock, "rounds_raw": got}
    print(f"env throughput side by side, {meta['cpu_count']} cores, median of {args.rounds} alternating rounds "
          f"x {args.steps} steps ({args.clock} clock)\n  this: {here}\n  base: {there}")
    print(f"{'offerings':>10} {'this st/s':>10} {'base st/s':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['offerings']:>10} {r['this_steps_per_s']:>10} {r['base_steps_per_s']:>10} {r['ratio']:>7}")
    out = Path(args.out).with_name(Path(args.out).stem + "_against.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--out", default="benchmarks/results/env.json")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or this process's CPU time (steadier on a machine others share)")
    ap.add_argument("--against", default=None, help="another checkout: alternate rounds with it, print the ratio")
    args = ap.parse_args()
    if args.against:
        return against(args)
    base = load_bundle()
    rows = []
    for n in args.sizes:
        env = CloudRouteEnv(resize_catalog(base, n), max_offerings=n, episode_requests=4096)
        measure(env, 500)  # warm-up
        rates = [measure(env, args.steps, args.clock) for _ in range(args.rounds)]
        rows.append({"offerings": n, "median_steps_per_s": round(statistics.median(rates)),
                     "min": round(min(rates)), "max": round(max(rates)), "us_per_step": round(1e6 / statistics.median(rates), 1)})
    meta = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "steps_per_round": args.steps, "rounds": args.rounds, "clock": args.clock, "target": ">= 20,000 steps/s at 100 offerings"}
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
