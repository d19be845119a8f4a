"""The hindsight oracle with its lookahead on a whole 100,000-request stream, beside every baseline:
what ``xroute evaluate --policy <each of the 8>`` does for one seed, timed policy by policy.

The stream (``tiled_bundle``): a shipped bundle's real hour (``default``: 28,185 requests of Azure's
LLM inference trace over 96 offerings) replayed back to back -- hour k's requests and its spot
availability trace shifted by k periods (the hour's span rounded up to the minute, plus a minute),
request ids made unique, prices unchanged -- cut at ``--requests`` (100,000: three hours and a
half). Written as a bundle and loaded (validated) like any other. It repeats the same hour, so
it is a scale test, not a realistic day; the oracle's dominance is also checked on the shipped
bundles' own whole streams with ``--shipped``. With ``--bundle mooncake`` (issue 39's stream: 3,993
requests of the Mooncake trace, 17 minutes, tiled 24 times to 96,000) the rows carry KV-prefix
blocks (``prefix_hashes``) and sessions, so the servers' prefix caches and the router's prefix view
(``envs.prefix``) are on -- as in ``xroute evaluate`` on that bundle, with the same ``cfg.env``:
nothing switches them on but the rows (the run prints whether they are on, and the JSON records
``prefix_caches`` and each policy's ``prefix_hit_rate``); the tiled hours repeat the same prefix
and session ids, so a later hour may find an earlier one's blocks still cached.

Every policy is run with ``models.evaluate.run_policy`` on one environment, back to back in this
process, as ``models.evaluate.evaluate`` runs them (the oracle last, handed the baselines' runs so
it does not play them again: ``Oracle.known``); the oracle plans in
``EvaluateConfig.oracle.workers`` forked processes (``models.planning``). Reported per policy: wall
seconds, CPU seconds (this process and its reaped children), mean reward; for the oracle, every
plan's total (the lookahead's, hindsight-greedy's, each baseline's), the plan it follows, the
lookahead's segments and replaced decisions; and whether the oracle scores at least every
heuristic. The machine's core count and load average are recorded: on a shared machine, say so.

    .venv/bin/python benchmarks/bench_oracle.py                       # 100k requests, 1 seed
    .venv/bin/python benchmarks/bench_oracle.py --shipped --rates 1 4 # + each shipped bundle's whole stream
    .venv/bin/python benchmarks/bench_oracle.py --bundle mooncake --requests 96000 \
        --out benchmarks/results/oracle_mooncake.json                # prefix caches on (issue 39's target)

Prints a table and writes ``benchmarks/results/oracle.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envs.cloud_route import CloudRouteEnv  # noqa: E402
from models.baselines import BASELINES, Oracle, make_baseline  # noqa: E402
from models.evaluate import known_plans, run_policy  # noqa: E402
from xroute.bundle import Bundle, bundle_root, load_bundle  # noqa: E402
from xroute.config import EvaluateConfig  # noqa: E402

HEURISTICS = [b for b in BASELINES if b != "oracle"]


def tiled_bundle(name: str, root: Path, requests: int) -> Bundle:
    """Bundle ``name``'s hour replayed back to back until ``requests`` requests (module docstring)."""
    src = bundle_root(name)
    root.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("workload.csv.gz", "availability.csv"):
            shutil.copy2(f, root / f.name)
    w = pd.read_csv(src / "workload.csv.gz", dtype=str, keep_default_na=False)
    ts = pd.to_datetime(w["ts"], utc=True, format="ISO8601")
    av_path = src / "availability.csv"
    av = pd.read_csv(av_path, dtype=str, keep_default_na=False) if av_path.exists() else None
    period = (ts.max() - ts.min()).ceil("min") + pd.Timedelta(minutes=1)
    parts, avail, total, k = [], [], 0, 0
    while total < requests:
        part = w.copy()
        part["ts"] = (ts + k * period).dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        part["request_id"] = part["request_id"] + f"~{k}"
        take = min(len(part), requests - total)
        parts.append(part.iloc[:take])
        total += take
        if av is not None:
            a = av.copy()
            a["ts"] = (pd.to_datetime(av["ts"], utc=True, format="ISO8601") + k * period).dt.strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ")
            avail.append(a)
        k += 1
    pd.concat(parts, ignore_index=True).to_csv(root / "workload.csv.gz", index=False)
    if avail:
        pd.concat(avail, ignore_index=True).to_csv(root / "availability.csv", index=False)
    return load_bundle(root)


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_stream(label: str, bundle: Bundle, cfg: EvaluateConfig, rate: float, seed: int) -> dict[str, Any]:
    """Every heuristic, then the oracle, for one seed on one stream, timed."""
    t0, c0 = time.perf_counter(), cpu_s()
    env = CloudRouteEnv(bundle, cfg.env.model_copy(update={"rate_scale": rate}))
    build = {"wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(cpu_s() - c0, 2)}
    # prefix caching (envs.prefix) is on wherever the stream's rows carry prefix_hashes (the mooncake
    # bundle), with the same settings as `xroute evaluate` (cfg.env): nothing to switch on
    print(f"  {label}: prefix caches {'ON' if env.has_prefix else 'off (no prefix_hashes)'}", flush=True)
    rows = []
    runs = []
    oracle: Oracle | None = None
    for name in [*HEURISTICS, "oracle"]:
        pol = make_baseline(name, cfg)
        if isinstance(pol, Oracle):  # as models.evaluate hands it the baselines' runs of this seed
            pol.known[seed] = known_plans(runs)
        t0, c0 = time.perf_counter(), cpu_s()
        run = run_policy(env, pol, seed)
        run.name = name
        runs.append(run)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        shown = getattr(pol, "display_name", name)
        rows.append({"policy": shown, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                     "mean_reward": run.metrics["mean_reward"], "sla_attainment": run.metrics["sla_attainment"],
                     **({"prefix_hit_rate": run.metrics["prefix_hit_rate"]} if "prefix_hit_rate" in run.metrics
                        else {})})
        print(f"  {label:22s} {shown:22s} {wall:7.1f} s wall {cpu:7.1f} s CPU  reward {run.metrics['mean_reward']:.6f}",
              flush=True)
        if isinstance(pol, Oracle):
            oracle = pol
    assert oracle is not None
    p = oracle.planned
    n = env.n_requests
    best_heuristic = max((r for r in rows if r["policy"] != rows[-1]["policy"]), key=lambda r: r["mean_reward"])
    return {
        "stream": label, "requests": n, "rate_scale": rate, "seed": seed, "prefix_caches": env.has_prefix,
        "env_build": build, "policies": rows,
        "total_wall_s": round(build["wall_s"] + sum(r["wall_s"] for r in rows), 1),
        "total_cpu_s": round(build["cpu_s"] + sum(r["cpu_s"] for r in rows), 1),
        "oracle": {"name": rows[-1]["policy"], "follows": p.name, "segments": p.segments, "replaced": p.replaced,
                   "phases_wall_s": p.seconds, "known_plans": sorted(oracle.known.get(seed, {})),
                   "plan_mean_reward": {k: round(v / n, 6) for k, v in p.totals.items()},
                   "lookahead_gain_over_hindsight_greedy": (round((p.totals["hindsight-rollout"]
                                                                   - p.totals["hindsight-greedy"]) / n, 6)
                                                            if "hindsight-rollout" in p.totals else None)},
        "best_heuristic": best_heuristic["policy"],
        "oracle_minus_best_heuristic": round(rows[-1]["mean_reward"] - best_heuristic["mean_reward"], 6),
        "oracle_minus_greedy": round(rows[-1]["mean_reward"]
                                     - next(r["mean_reward"] for r in rows if r["policy"] == "greedy"), 6),
        "oracle_dominates": all(rows[-1]["mean_reward"] >= r["mean_reward"] for r in rows[:-1]),
    }


#: (bundle, first request, load) of the --tradeoff windows
TRADEOFF_WINDOWS = [("default", 0, 1.0), ("default", 15000, 4.0), ("feb2024", 5000, 1.0), ("mar2024", 8000, 4.0)]
#: (top_k, horizon, max_regret) of the --tradeoff: the oracle before issue 26, the default, cheaper ones
TRADEOFF_CONFIGS = [(3, 12, None), (3, 12, 0.008), (3, 12, 0.004), (2, 12, None), (3, 6, None), (2, 24, None)]


def tradeoff(requests: int) -> list[dict[str, Any]]:
    """The lookahead plan alone (one process) for each of ``TRADEOFF_CONFIGS`` on ``requests``-request
    windows: its mean reward over hindsight-greedy's, and its CPU seconds."""
    import copy

    from models import planning

    cfg = EvaluateConfig()
    out = []
    for name, start, rate in TRADEOFF_WINDOWS:
        b = load_bundle(bundle_root(name))
        b = b.select(np.arange(start, min(start + requests, len(b.workload))))
        env = CloudRouteEnv(b, cfg.env.model_copy(update={"rate_scale": rate}))
        env.reset(seed=0)
        n = env.steps_left
        hg = planning.greedy_plan(copy.deepcopy(env))[1] / n
        row: dict[str, Any] = {"window": f"{name}[{start}:{start + n}] x{rate:g}", "hindsight_greedy": round(hg, 6)}
        for k, h, mr in TRADEOFF_CONFIGS:
            c0 = time.process_time()
            acts = planning.lookahead(copy.deepcopy(env), k, h, max_regret=mr)
            cpu = time.process_time() - c0
            total = planning.replay(copy.deepcopy(env), acts)[1] / n
            row[f"top_k={k} horizon={h} max_regret={mr}"] = {"gain": round(total - hg, 6), "cpu_s": round(cpu, 1)}
        print("  " + row["window"] + "  " + "  ".join(
            f"({key.split(' ')[0][6:]},{key.split(' ')[1][8:]},{key.split(' ')[2][11:]}) "
            f"{v['gain'] * 1e4:+.1f}e-4 {v['cpu_s']:.0f}s" for key, v in row.items() if isinstance(v, dict)),
            flush=True)
        out.append(row)
    return out


def snapshot_ab(bundle: str, requests: int, repeats: int = 3) -> dict[str, Any]:
    """The lookahead alone (one process, ``EvaluateConfig.oracle``'s top_k, horizon, max_regret) on
    ``bundle``'s first ``requests`` tiled requests, its snapshots copied (before issue 39) and shared
    with in-place restores (now), alternately ``repeats`` times: median wall and CPU seconds of each,
    and whether the two took the same decisions (they must)."""
    import copy
    import statistics

    from models import planning

    cfg = EvaluateConfig()
    oc = cfg.oracle
    with tempfile.TemporaryDirectory() as tmp:
        env = CloudRouteEnv(tiled_bundle(bundle, Path(tmp) / "ab", requests), cfg.env)
    env.reset(seed=cfg.seed)
    times: dict[str, list[tuple[float, float]]] = {"copied": [], "shared": []}
    plans: dict[str, list[int]] = {}
    for rep in range(repeats):
        for mode in (("copied", "shared") if rep % 2 == 0 else ("shared", "copied")):
            sim = copy.deepcopy(env)
            t0, c0 = time.perf_counter(), time.process_time()
            plans[mode] = planning.lookahead(sim, oc.top_k, oc.horizon, max_regret=oc.max_regret,
                                             share_snapshots=mode == "shared")
            times[mode].append((time.perf_counter() - t0, time.process_time() - c0))
            print(f"  lookahead, snapshots {mode}: {times[mode][-1][0]:.1f} s wall {times[mode][-1][1]:.1f} s CPU",
                  flush=True)
    med = {m: {"wall_s": round(statistics.median(w for w, _ in v), 2),
               "cpu_s": round(statistics.median(c for _, c in v), 2)} for m, v in times.items()}
    return {"bundle": bundle, "requests": env.n_requests, "prefix_caches": env.has_prefix, "repeats": repeats,
            "median": med, "cpu_ratio_copied_over_shared": round(med["copied"]["cpu_s"] / med["shared"]["cpu_s"], 2),
            "same_decisions": plans["copied"] == plans["shared"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000, help="requests of the tiled stream")
    ap.add_argument("--bundle", default="default", help="the shipped bundle whose hour is tiled")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--shipped", action="store_true", help="also each shipped bundle's whole stream")
    ap.add_argument("--no-tiled", action="store_true", help="skip the tiled stream (with --shipped or --tradeoff)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0], help="loads of the --shipped streams")
    ap.add_argument("--workers", type=int, default=None, help="oracle.workers (default: the config's)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--horizon", type=int, default=None)
    ap.add_argument("--max-regret", default=None, help="oracle.max_regret (a number, or 'none')")
    ap.add_argument("--segment-requests", type=int, default=None, help="oracle.segment_requests")
    ap.add_argument("--burn-in-requests", type=int, default=None, help="oracle.burn_in_requests")
    ap.add_argument("--tradeoff", type=int, default=0, metavar="N",
                    help="also the lookahead's quality and cost per (top_k, horizon, max_regret) on N-request windows")
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="also the lookahead alone on N requests of --bundle's tiled stream, snapshots copied vs "
                         "shared (issue 39), 3 times each alternately")
    ap.add_argument("--out", default="benchmarks/results/oracle.json")
    args = ap.parse_args()
    if args.requests < 1000:
        ap.error(f"--requests must be at least 1000 (got {args.requests})")
    cfg = EvaluateConfig()
    upd: dict[str, Any] = {k: v for k, v in (("workers", args.workers), ("top_k", args.top_k),
                                             ("horizon", args.horizon), ("segment_requests", args.segment_requests),
                                             ("burn_in_requests", args.burn_in_requests)) if v is not None}
    if args.max_regret is not None:
        upd["max_regret"] = None if args.max_regret.lower() == "none" else float(args.max_regret)
    cfg = cfg.model_copy(update={"oracle": cfg.oracle.model_copy(update=upd)})
    load0 = os.getloadavg()
    streams = []
    print(f"oracle {cfg.oracle.model_dump()}; {os.cpu_count()} cores, load average {load0[0]:.1f}", flush=True)
    if not args.no_tiled:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            long = tiled_bundle(args.bundle, Path(tmp) / "tiled", args.requests)
            span = long.time_span()
            print(f"tiled stream: {len(long.workload):,} requests, {span[0]:%Y-%m-%d %H:%M} .. {span[1]:%H:%M} UTC "
                  f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
            for s in range(args.seeds):
                streams.append(run_stream(f"{args.bundle} tiled {len(long.workload) // 1000}k", long, cfg, 1.0,
                                          cfg.seed + s))
    if args.shipped:
        for name in ("default", "feb2024", "mar2024"):
            b = load_bundle(bundle_root(name))
            for rate in args.rates:
                streams.append(run_stream(f"{name} x{rate:g}", b, cfg, rate, cfg.seed))
    trade = []
    if args.tradeoff:
        print(f"lookahead quality and cost on {args.tradeoff}-request windows (one process):")
        trade = tradeoff(args.tradeoff)
    ab = None
    if args.ab:
        print(f"the lookahead's snapshots, copied vs shared, on {args.ab:,} requests of {args.bundle} (one process):")
        ab = snapshot_ab(args.bundle, args.ab)
        print(f"  median CPU s: copied {ab['median']['copied']['cpu_s']}, shared {ab['median']['shared']['cpu_s']} "
              f"({ab['cpu_ratio_copied_over_shared']}x); same decisions: {ab['same_decisions']}", flush=True)
    load1 = os.getloadavg()
    print()
    n_pol = len(streams[0]["policies"]) if streams else 0
    print(f"| stream | requests | {n_pol} policies: wall s | CPU s | oracle wall s | oracle CPU s | oracle plan followed | "
          "lookahead − hindsight-greedy | oracle − best heuristic | dominates |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for st in streams:
        o = next(r for r in st["policies"] if r["policy"].startswith("oracle"))
        g = st["oracle"]["lookahead_gain_over_hindsight_greedy"]
        print(f"| {st['stream']} (seed {st['seed']}) | {st['requests']:,} | {st['total_wall_s']:.0f} | "
              f"{st['total_cpu_s']:.0f} | {o['wall_s']:.0f} | {o['cpu_s']:.0f} | {st['oracle']['follows']} "
              f"({st['oracle']['segments']} segments, {st['oracle']['replaced']} replaced) | "
              f"{'—' if g is None else f'{g:+.6f}'} | {st['oracle_minus_best_heuristic']:+.6f} "
              f"({st['best_heuristic']}) | {'yes' if st['oracle_dominates'] else 'NO'} |")
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "load_average_before": [round(x, 2) for x in load0],
                       "load_average_after": [round(x, 2) for x in load1]},
           "oracle_config": cfg.oracle.model_dump(), "streams": streams, "tradeoff": trade, "snapshot_ab": ab,
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
