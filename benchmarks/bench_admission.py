"""Admission that predicts (issue 36; ``docs/router.md``, "Admission, priority and fairness"): what
admission itself costs, and what it costs a decision.

1. Admission's own cost, per request, in process: the ``predict`` stage (the best predicted TTFT
   over the feasible pools and the verdict: ``router.decision.stages.Predict``) as it runs inside
   each ranking (the engine's stage timer), and the queue's bookkeeping for a request that waits
   (``FairQueue.push``, ``first`` over 8 backlogged tenants' counters with 64 requests waiting,
   ``remove``, the verdict and the counter's move). Target (issue 36): p99 <= 20 us.
2. The service's decision (``router.service.admission.decide``: rank, one admission of the pool
   -- with admission on, and the fairness counter in the same call -- the engine's admission) on
   the shipped bundle with the embedded state, admission off and on, in interleaved rounds: the
   decision rate of each round, the ratio on/off per round, its median. Target (issue 36): >= 0.9.

Usage::

    .venv/bin/python benchmarks/bench_admission.py            # ~1 min

Prints a markdown table and writes ``benchmarks/results/admission.json``.
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _pct(xs: list[float] | np.ndarray) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 2), "p99_us": round(float(np.percentile(a, 99)), 2)}


def bench_queue(n: int) -> dict[str, float]:
    """One waiting request's bookkeeping: push, the first by the counters, remove, the verdict and
    the counter's move, with 64 requests of 8 tenants in 3 bands waiting."""
    from router.service.admission_queue import FairQueue
    from xroute import admission_rules as rules

    class W:
        __slots__ = ("band", "seq", "tenant")

        def __init__(self, band: int, tenant: str, seq: int):
            self.band, self.tenant, self.seq = band, tenant, seq

    q: FairQueue[Any] = FairQueue()
    tenants = [f"t{k}" for k in range(8)]
    counters = {t: float(k) for k, t in enumerate(tenants)}
    for i in range(64):
        q.push(W(i % 3, tenants[i % 8], i))
    ts = np.empty(n)
    for i in range(n):
        w = W(1 + i % 2, tenants[i % 8], 64 + i)
        t0 = time.perf_counter()
        q.push(w)
        rules.verdict("standard", 2500.0, 2000.0, 10.0)
        first = q.first(counters)
        q.remove(first)
        counters[first.tenant] += rules.service(400, 80, 1.0)
        ts[i] = time.perf_counter() - t0
        q.push(first)  # (the queue keeps its size)
    return _pct(ts[1000:])


def _engines(work: Path) -> dict[str, Any]:
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine

    (work / "router.yaml").write_text("{}\n")
    return {v: RoutingEngine(load_settings(work / "router.yaml", model_uri="", db_path=work / "d.db",
                                           tenants={"bench": {}}, replay_speed=1e-6,
                                           admission={"enabled": v == "on"}))
            for v in ("off", "on")}


def bench_decide(n: int, rounds: int) -> dict[str, Any]:
    """The decision with admission off and on (module docstring, 2), and the predict stage's time."""
    from router.state.base import Settlement
    from router.state.embedded import EmbeddedState
    from tests.state_support import decide
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    work = Path(tempfile.mkdtemp(prefix="xroute-bench-admission-"))
    engines = _engines(work)
    states = {v: EmbeddedState() for v in engines}
    predict: list[float] = []
    engines["on"].stage_timer = lambda name, s: predict.append(s) if name == "predict" else None
    who = Principal("bench", "tenant", "k")
    origins = engines["off"].origins
    reqs = [RouteRequest.model_validate({"origin": origins[i % len(origins)], "input_tokens": 200 + (i * 37) % 1800,
                                         "max_output_tokens": 10 + (i * 13) % 40, "ttft_ms": 2000, "tpot_ms": 100,
                                         "priority": ("critical", "standard")[i % 2]})
            for i in range(n)]
    wall0 = engines["off"].source.start_wall
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for v in (("off", "on") if r % 2 == 0 else ("on", "off")):
            eng, st = engines[v], states[v]
            t_all = 0.0
            for i, req in enumerate(reqs):
                did = f"d_{r}_{i}"
                t0 = time.perf_counter()
                decide(eng, req, who, did, wall0 + i * 1e-3, state=st)
                t_all += time.perf_counter() - t0
                st.core.settle(Settlement(did))  # (the pools would fill: this measures the decision)
            rates[v].append(n / t_all)
    shutil.rmtree(work, ignore_errors=True)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    return {"off_per_s": round(float(np.median(rates["off"]))), "on_per_s": round(float(np.median(rates["on"]))),
            "ratio_median": round(float(np.median(ratios)), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "predict_stage": _pct(predict[len(predict) // 10:])}


def table(res: dict[str, Any]) -> str:
    d, q = res["decide"], res["queue"]
    p = d["predict_stage"]
    lines = [f"Admission ({res['cpus']} CPUs, {res['python']}, {res['rounds']} rounds of {res['n']} decisions)", "",
             "| measure | p50 | p99 | target |", "|---|---|---|---|",
             f"| predict stage (in each ranking) | {p['p50_us']} us | {p['p99_us']} us | |",
             f"| queue bookkeeping (a waiting request) | {q['p50_us']} us | {q['p99_us']} us | |",
             f"| admission's own cost (sum of the p99s) | | {res['admission_p99_us']} us | <= 20 us |", "",
             "| decisions/s (decide, embedded state) | off | on | on/off (median, range) | target |",
             "|---|---|---|---|---|",
             f"| shipped bundle, greedy | {d['off_per_s']} | {d['on_per_s']} | {d['ratio_median']} "
             f"({d['ratio_range'][0]}-{d['ratio_range'][1]}) | >= 0.9 |"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="decisions per round")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    res: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "n": a.n, "rounds": a.rounds}
    res["queue"] = bench_queue(50_000)
    res["decide"] = bench_decide(a.n, a.rounds)
    res["admission_p99_us"] = round(res["decide"]["predict_stage"]["p99_us"] + res["queue"]["p99_us"], 2)
    out = REPO / "benchmarks" / "results" / "admission.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
