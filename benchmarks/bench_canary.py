"""A canary rollout's cost in the decision path, side by side in one run (``docs/policies.md``,
"Canary rollouts").

In process (``RoutingEngine.rank`` + ``admit``, the greedy fallback, 100 offerings, the 50 policies
of ``bench_policies.py`` as the stable set), the variants' engines interleaved in rounds, each round
``--decisions`` decisions; decisions/s and p50/p99 per variant, the ratio to ``no_canary`` per
round (median, range) and at the median decision:

* ``no_canary`` -- this tree, no canary running (the ``arm`` stage: one attribute read);
* ``canary_30_request`` -- a canary at 30 % by request id running (the canary set: the stable set
  less one policy): one blake2b per decision, the environment switched between the two compiled
  sets whenever the arm changes (about 42 % of decisions), the arm on the row, its exclusions
  counted;
* ``baseline_tree`` (with ``--baseline PATH``, e.g. a checkout of the branch before the canary):
  the same no-canary measurement run on that tree's code, in a subprocess per round, interleaved
  with the others -- this tree's ``no_canary`` against the code without the canary at all.

Also the arm choice alone (``CanaryArms.choose``), per call; and (part ``compare``) the comparison's
queries (``router.service.canary.arm_rows``: both arms) on a SQLite log of 200,000 decisions --
100,000 made under a canary (30 % in its arm), a third of all with feedback -- written straight
into the tables, at windows of 10,000 and 100,000, medians of 5.

Usage::

    .venv/bin/python benchmarks/bench_canary.py --baseline /path/to/main-checkout   # ~2 min
    .venv/bin/python benchmarks/bench_canary.py --decisions 2000 --rounds 2         # quicker
    .venv/bin/python benchmarks/bench_canary.py --parts compare                     # the comparison's reads only

Writes ``benchmarks/results/canary.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _tree_first(tree: Path) -> None:
    """Import ``router`` (and the rest) from ``tree``: first on the path."""
    sys.path[:] = [str(tree)] + [p for p in sys.path if Path(p or ".").resolve() != REPO]


def _pct(xs: list[float]) -> dict[str, float]:
    import numpy as np

    a = np.asarray(xs) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 2), "p99_us": round(float(np.percentile(a, 99)), 2),
            "mean_us": round(float(a.mean()), 2)}


def _engine(bundle: Path, work: Path, canary: bool) -> Any:
    """An engine on ``bundle`` with the 50 policies installed, and a 30 % canary by request when asked."""
    from benchmarks.bench_policies import TENANT, policy_set
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine

    cfg = work / "router.yaml"
    cfg.write_text("{}\n")
    eng = RoutingEngine(load_settings(cfg, telemetry=bundle, model_uri="", max_telemetry_age_s=1e9,
                                      tenants={TENANT: {}}))
    ps = policy_set(eng.catalog).model_copy(update={"version": 1})
    if not canary:
        eng.install_policies(eng.compile_policies(ps))
        return eng
    from xroute.schema.policy_ir import Canary, PolicySet

    draft = ps.model_copy(update={"policies": ps.policies[1:], "version": 2})
    doc = PolicySet.model_validate({**ps.model_dump(mode="json", exclude_none=True), "version": 2, "canary": Canary(
        id="bench", key="request", share=30.0, policy_set=draft, version=2, base_version=1, started_at=0.0,
        principal="bench").model_dump(mode="json", exclude_none=True)})
    eng.install_policies(eng.compile_policies(doc), eng.compile_canary(doc))
    return eng


def measure(bundle: Path, work: Path, canary: bool, n: int, warm: bool) -> dict[str, float]:
    """``n`` decisions on a fresh engine (the first ``n // 10`` not timed when ``warm``)."""
    from benchmarks.bench_policies import TENANT
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    eng = _engine(bundle, work, canary)
    who = Principal(TENANT, "tenant", "k")
    origins = eng.origins
    reqs = [RouteRequest(origin=origins[i % len(origins)], input_tokens=200 + (i * 37) % 1800,
                         max_output_tokens=10 + (i * 13) % 60, ttft_ms=2000.0, tpot_ms=100.0) for i in range(256)]
    wall0 = eng.source.start_wall
    skip = n // 10 if warm else 0
    times = []
    arms = 0
    for i in range(n + skip):
        t0 = time.perf_counter()
        r = eng.rank(reqs[i % 256], who, f"d_{i}", wall0 + 0.02 * i)
        eng.admit(r, 0)
        times.append(time.perf_counter() - t0)
        arms += bool(getattr(r, "arm", False))
    p = _pct(times[skip:])
    p["decisions_per_s"] = round(1e6 / p["mean_us"], 1)
    p["canary_share_seen"] = round(arms / (n + skip), 3)
    return p


def _worker(a: argparse.Namespace) -> None:
    _tree_first(a.tree)
    print(json.dumps(measure(a.bundle, a.work, False, a.decisions, True)))


def _baseline_round(tree: Path, bundle: Path, work: Path, n: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--worker", "--tree", str(tree), "--bundle", str(bundle),
                          "--work", str(work), "--decisions", str(n)], env=env, capture_output=True, text=True,
                         check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _choose_ns(n: int = 200_000) -> float:
    from benchmarks.bench_policies import policy_set  # noqa: F401  (the same import cost as the engines')
    from router.decision.canary import CanaryArms
    from xroute.schema.policy_ir import Canary, PolicySet

    arms = CanaryArms(Canary(id="bench", key="request", share=30.0, policy_set=PolicySet(version=1), version=1,
                             base_version=0, started_at=0.0, principal="b"), _empty(), 1)
    keys = [f"{i:016x}" for i in range(1024)]
    t0 = time.perf_counter()
    for i in range(n):
        arms.choose(keys[i & 1023])
    return round((time.perf_counter() - t0) / n * 1e9, 1)


def _empty() -> Any:
    from envs import policies as env_policies
    from xroute.schema.policy_ir import PolicySet

    return env_policies.CompiledPolicies(PolicySet(), [])


def run(a: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import benchmarks.bench_router as br

    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-canary-"))
    try:
        bundle = br.make_bundle(work / "bundle100", 100)
        per: dict[str, list[dict[str, float]]] = {"no_canary": [], "canary_30_request": []}
        if a.baseline:
            per["baseline_tree"] = []
        for r in range(a.rounds):
            order = list(per)[r % len(per):] + list(per)[:r % len(per)]  # (rotated: no variant always first)
            for v in order:
                if v == "baseline_tree":
                    per[v].append(_baseline_round(a.baseline, bundle, work, a.decisions))
                else:
                    per[v].append(measure(bundle, work, v != "no_canary", a.decisions, True))
        out: dict[str, Any] = {}
        base = per["no_canary"]
        for v, runs in per.items():
            x = {k: round(float(np.median([p[k] for p in runs])), 3) for k in ("p50_us", "p99_us", "decisions_per_s",
                                                                                "canary_share_seen")}
            ratios = [p["decisions_per_s"] / b["decisions_per_s"] for p, b in zip(runs, base)]
            x["throughput_ratio_to_no_canary"] = {"median": round(float(np.median(ratios)), 3),
                                                  "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
            x["p50_ratio_no_canary_to_this"] = round(float(np.median([b["p50_us"] / p["p50_us"]
                                                                      for p, b in zip(runs, base)])), 3)
            out[v] = x
        return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "load_average_at_start": load0, "decisions_per_round": a.decisions, "rounds": a.rounds,
                "baseline": str(a.baseline) if a.baseline else None, "engine": out,
                "choose_ns_per_call": _choose_ns(), "load_average_at_end": os.getloadavg()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_compare(work: Path) -> dict[str, Any]:
    """Part ``compare`` (module docstring): milliseconds per comparison read, by window."""
    import random
    import sqlite3
    import statistics

    from router.service.canary import arm_rows
    from router.store.rows import ARM_SQL, DECISION_COLUMNS
    from router.store.sqlite import DecisionStore

    path = work / "compare.db"
    DecisionStore(path)._conn.close()  # (the log's schema, its added columns and indexes)
    rng = random.Random(0)
    base = {c: None for c in DECISION_COLUMNS} | dict(
        tenant="a", telemetry_ts=0.0, origin="o", input_tokens=1, max_output_tokens=1, ttft_ms=1.0, tpot_ms=1.0,
        model="m", offering_id="x", expected_latency_ms=1.0, expected_cost_usd=0.001, policy="g", policy_kind="k",
        bundle_hash="h", request_json="{}", response_json="{}")
    n, t = 200_000, 1.7e9
    rows = []
    for i in range(n):
        arm = None if i < n // 2 else ("canary:c1" if rng.random() < 0.3 else "stable:c1")
        v = base | {"decision_id": f"d_{i:032x}", "created_at": t + i * 0.01, "policy_arm": arm}
        rows.append(tuple(v[c] for c in DECISION_COLUMNS))
    conn = sqlite3.connect(path)
    conn.executemany(f"INSERT INTO decisions ({', '.join(DECISION_COLUMNS)}) VALUES "
                     f"({', '.join('?' * len(DECISION_COLUMNS))})", rows)
    conn.executemany("INSERT INTO feedback (decision_id, tenant, received_at, latency_ms, cost_usd, failed, "
                     "sla_violation) VALUES (?, ?, ?, ?, ?, ?, ?)",
                     [(f"d_{i:032x}", "a", t, 1.0, 0.002, 0, int(i % 7 == 0)) for i in range(0, n, 3)])
    conn.commit()
    plan = [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + ARM_SQL, ("stable:c1", 10))]
    conn.close()
    out: dict[str, Any] = {"decisions": n, "under_canary": n // 2, "plan": plan}
    for w in (10_000, 100_000):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            arm_rows(path, "c1", w)
            ts.append(time.perf_counter() - t0)
        out[f"window_{w}_ms"] = round(statistics.median(ts) * 1000, 1)
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"machine: {res['machine']}; load average {res['load_average_at_start']} -> {res['load_average_at_end']}",
             f"{res['rounds']} rounds x {res['decisions_per_round']} decisions (RoutingEngine.rank + admit, greedy, "
             "100 offerings, 50 policies); medians over rounds", "",
             "| variant | decisions/s | p50 µs | p99 µs | throughput ratio to no_canary (median, range) "
             "| p50 ratio no_canary/this |", "|---|---:|---:|---:|---|---:|"]
    for v, x in res["engine"].items():
        r = x["throughput_ratio_to_no_canary"]
        lines.append(f"| {v} | {x['decisions_per_s']} | {x['p50_us']} | {x['p99_us']} | {r['median']} "
                     f"({r['min']}-{r['max']}) | {x['p50_ratio_no_canary_to_this']} |")
    lines += ["", f"arm choice alone (CanaryArms.choose: one blake2b): {res['choose_ns_per_call']} ns per call"]
    c = res.get("compare")
    if c:
        lines += ["", f"comparison read, both arms, SQLite log of {c['decisions']} decisions ({c['under_canary']} under "
                  f"the canary): window 10,000: {c['window_10000_ms']} ms; window 100,000: {c['window_100000_ms']} ms",
                  f"plan: {'; '.join(c['plan'])}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=10000, help="timed decisions per variant and round (>= 100)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout without the canary, measured alongside")
    ap.add_argument("--parts", default="engine,compare", help="engine, compare, or both (comma-separated); a part not "
                                                             "run keeps its figures from --out")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "canary.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a)
        return
    if a.decisions < 100 or a.rounds < 1:
        ap.error("--decisions must be >= 100 and --rounds >= 1")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    parts = set(a.parts.split(","))
    res: dict[str, Any] = json.loads(a.out.read_text()) if a.out.exists() else {}
    if "engine" in parts:
        res.update(run(a))
    if "compare" in parts:
        work = Path(tempfile.mkdtemp(prefix="bench-canary-"))
        try:
            res["compare"] = bench_compare(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
