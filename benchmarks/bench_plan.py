"""``xroute plan``'s planning step at 100 pools, on one core: ``models.capacity_plan.PlanMaker.plan``.

What is timed is what ``xroute plan`` and ``GET /v1/capacity/plan`` do per plan, after the bundle is
loaded and the planner and the provisioning world are built (the CLI's start and the router's first
call pay those once): the decision-time view at the plan's time (``ProvisionWorld.decision_view``:
the history before it, the telemetry at it, the inventory), a fresh planner's ``reset`` and ``plan``,
and the ``CapacityPlan`` with its reasons. The catalog is the shipped bundle's 96 offerings cycled
to 100 (``resize_catalog``): 100 pools of llama-2-7b; the plan times are ``--instants`` instants
spread over the shipped stream's second half (its whole first half and more is history). Planners:
the four baselines, and a learned planner (``models.planner_policy``) with a random two-layer
scorer (the shipped one is registered in MLflow only after a ``xroute train-planner`` run; its
inference is the same arithmetic and ILP). The process is pinned to one core, BLAS threads to one.
Medians, 95th percentiles and maxima over ``--rounds`` x ``--instants`` plans; the target is
<= 100 ms a plan (issue 37).

    .venv/bin/python benchmarks/bench_plan.py [--rounds 3] [--instants 20]
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from models.capacity_plan import PlanMaker  # noqa: E402
from models.planner_net import N_CONTEXT, N_POOL, Knobs, PlannerWeights, save_planner  # noqa: E402
from xroute.bundle import load_bundle, to_seconds  # noqa: E402
from xroute.catalog_tools import resize_catalog  # noqa: E402

BASELINES = ("static-ondemand", "autoscaler", "spothedge", "melange")


def learned_export(root: Path) -> Path:
    """A learned planner's export with a random two-layer scorer (every feature reaches the output)."""
    rng = np.random.default_rng(0)
    w = PlannerWeights([(rng.normal(0, 0.5, (N_POOL + N_CONTEXT, 16)), rng.normal(0, 0.1, 16)),
                        (rng.normal(0, 0.5, (16, 2)), np.zeros(2))], Knobs(margin=0.1, hedge=0.3, hazard_price=0.5))
    return save_planner(w, root / "learned")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--instants", type=int, default=20)
    ap.add_argument("--pools", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/plan.json")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    bundle = resize_catalog(load_bundle(), args.pools)
    t = to_seconds(bundle.workload["ts"])
    instants = np.linspace(t[len(t) // 2], t[-1], args.instants).tolist()
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = [*BASELINES, str(learned_export(Path(tmp)))]
        for name in names:
            t0 = time.perf_counter()
            maker = PlanMaker(bundle, name)
            build_s = time.perf_counter() - t0
            maker.plan(instants[0])  # warm-up
            ts = []
            for _ in range(args.rounds):
                for at in instants:
                    t0 = time.perf_counter()
                    plan = maker.plan(at)
                    ts.append(time.perf_counter() - t0)
            ms = sorted(1000 * x for x in ts)
            rows.append({"planner": "learned (random scorer)" if name not in BASELINES else name,
                         "pools": len(plan.pools), "plans": len(ts), "median_ms": round(statistics.median(ms), 2),
                         "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 2), "max_ms": round(ms[-1], 2),
                         "build_s": round(build_s, 3)})
    meta = {"cores_used": 1, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "load_average_before": [round(x, 2) for x in load0],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "rounds": args.rounds,
            "instants": args.instants, "requests": len(bundle.workload), "target": "<= 100 ms a plan at 100 pools"}
    print(f"xroute plan's planning step at {args.pools} pools, 1 core (of {meta['cpu_count']}), load average "
          f"{meta['load_average_before'][0]:.2f} -> {meta['load_average_after'][0]:.2f}; {args.rounds} x "
          f"{args.instants} plans")
    print(f"{'planner':<26} {'pools':>5} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} {'build s':>8}")
    for r in rows:
        print(f"{r['planner']:<26} {r['pools']:>5} {r['median_ms']:>10} {r['p95_ms']:>8} {r['max_ms']:>8} "
              f"{r['build_s']:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
