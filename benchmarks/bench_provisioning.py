"""The provisioning world's speed at 100 pools, and each planner's time per plan (one core, one process).

The catalog is the shipped bundle's 96 offerings cycled to 100 (``resize_catalog``): 100 pools of
llama-2-7b. The window is the shipped stream after its training split (the split's requests are
the planners' history), replayed at ``--rates`` (x1 is the real load, about 480 requests a minute;
x0.25 stretches the same requests over four times as many epochs). The world is driven by
SpotHedge's plans -- spot spread over its locations, on-demand fallback, the real spot traces'
notices and migrations -- and only ``ProvisionWorld.step`` is timed. Each planner's ``plan`` is
timed at every epoch of the same window (the oracle plans the whole window once, at reset: its
time is reported per window and per epoch). Medians of ``--rounds`` rounds; the core count and the
load average are recorded, since the machine may be shared.

    .venv/bin/python benchmarks/bench_provisioning.py [--rounds 5] [--rates 1 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from envs.provisioning import ProvisionWorld
from models.config import load_train_config
from models.planners import HindsightOracle, make_planner
from models.scenarios import split_bundle
from xroute.bundle import load_bundle
from xroute.catalog_tools import resize_catalog

PLANNERS = ("static-ondemand", "autoscaler", "spothedge", "melange")


def world_rate(world: ProvisionWorld, seed: int) -> tuple[float, float, int]:
    """(epochs/s, requests/s, epochs) of ``world.step`` alone, SpotHedge planning."""
    planner = make_planner("spothedge")
    planner.reset(world.reset(seed=seed))
    spent = 0.0
    n = 0
    while True:
        tg = planner.plan(world.view())
        t = time.perf_counter()
        res = world.step(tg)
        spent += time.perf_counter() - t
        n += 1
        if res.done:
            break
    return n / spent, world.N / spent, n


def plan_times(world: ProvisionWorld, name: str, seed: int) -> list[float]:
    """Seconds of each ``plan`` call over the window (the oracle: its reset, once)."""
    planner = make_planner(name)
    if isinstance(planner, HindsightOracle):
        planner.bind(world)
    ctx = world.reset(seed=seed)
    t = time.perf_counter()
    planner.reset(ctx)
    out = [time.perf_counter() - t] if isinstance(planner, HindsightOracle) else []
    while True:
        v = world.view()
        t = time.perf_counter()
        tg = planner.plan(v)
        if not isinstance(planner, HindsightOracle):
            out.append(time.perf_counter() - t)
        if world.step(tg).done:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--pools", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/provisioning.json")
    args = ap.parse_args()
    bundle = resize_catalog(load_bundle(), args.pools)
    sp = split_bundle(bundle, load_train_config(None).split)
    t1 = sp.windows["train"][1]
    window, history = bundle.window(t1, None), sp.bundles["train"].workload
    load0 = os.getloadavg()
    rows = []
    for rate in args.rates:
        world = ProvisionWorld(window, history=history, rate_scale=rate)
        world_rate(world, 0)  # warm-up (compiles or loads the kernels)
        runs = [world_rate(world, r) for r in range(args.rounds)]
        eps = [r[0] for r in runs]
        rps = [r[1] for r in runs]
        rows.append({"what": "world", "pools": world.P, "rate_scale": rate, "epochs": runs[0][2],
                     "requests_per_epoch": round(world.N / runs[0][2], 1),
                     "median_epochs_per_s": round(statistics.median(eps)), "min": round(min(eps)),
                     "max": round(max(eps)), "median_requests_per_s": round(statistics.median(rps)),
                     "us_per_epoch": round(1e6 / statistics.median(eps), 1)})
    world = ProvisionWorld(window, history=history)
    for name in (*PLANNERS, "oracle"):
        plan_times(world, name, 0)  # warm-up
        ts = [x for r in range(args.rounds) for x in plan_times(world, name, r)]
        med = statistics.median(ts)
        row = {"what": f"plan: {name}", "pools": world.P, "epochs": world.E, "median_ms": round(1000 * med, 3),
               "max_ms": round(1000 * max(ts), 3)}
        if name == "oracle":
            row["per_epoch_ms"] = round(1000 * med / world.E, 3)
        rows.append(row)
    meta = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load0],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "rounds": args.rounds,
            "window": f"{window.time_span()[0]} .. {window.time_span()[1]}", "requests": len(window.workload),
            "targets": ">= 5,000 epochs/s at 100 pools; a plan for 100 pools in <= 100 ms on one core"}
    print(f"provisioning world at {args.pools} pools, {meta['cpu_count']} cores, load average "
          f"{meta['load_average_before'][0]:.2f} -> {meta['load_average_after'][0]:.2f}, median of {args.rounds} rounds")
    print(f"{'':<24} {'rate':>5} {'req/epoch':>10} {'epochs/s':>10} {'us/epoch':>10} {'req/s':>11} {'min':>8} {'max':>8}")
    for r in rows:
        if r["what"] == "world":
            print(f"{'world.step':<24} {r['rate_scale']:>5g} {r['requests_per_epoch']:>10} {r['median_epochs_per_s']:>10} "
                  f"{r['us_per_epoch']:>10} {r['median_requests_per_s']:>11} {r['min']:>8} {r['max']:>8}")
    print(f"{'':<24} {'epochs':>6} {'median ms':>10} {'max ms':>10}")
    for r in rows:
        if r["what"].startswith("plan"):
            extra = f"  (the whole window; {r['per_epoch_ms']} ms an epoch)" if "per_epoch_ms" in r else ""
            print(f"{r['what']:<24} {r['epochs']:>6} {r['median_ms']:>10} {r['max_ms']:>10}{extra}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
