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
   A third engine in the same rounds, ``before``, runs the ``predict`` stage as it was before its
   compiled best TTFT (``envs.admission.best_ttft_of``; numpy temporaries): the stage's p50/p99
   before and after, side by side.
3. HTTP (``--http``; needs wrk): ``POST /v1/route`` of ``xroute serve`` (one worker, greedy,
   shipped bundle, embedded state) with admission off and on, both servers up throughout, in
   ``--rounds`` rounds of alternating order, each run paired with the trivial endpoint of
   ``bench_router.py`` (as ``bench_quotas.py --http`` does: the machine's drift does not bias the
   ratio); capacity ample (every accelerator's ``max_concurrency`` x1000, so nothing queues: the
   ``on`` server's ``xroute_router_admission_total`` is read after the runs to show it) --
   reported: median req/s, p99, the server's CPU per request, and the ratio on/off of each
   round's ``vs_trivial`` (median and range). Target (issue 36): >= 0.9.

Usage::

    .venv/bin/python benchmarks/bench_admission.py                          # 1 and 2 (~1 min)
    .venv/bin/python benchmarks/bench_admission.py --http --duration 10     # and 3 (~3 min more)

Prints a markdown table and writes ``benchmarks/results/admission.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


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
    """Admission off, on, and ``before``: on with the ``predict`` stage as it was before its compiled
    best (:class:`_PredictBefore`), so the stage's before and after are timed side by side."""
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine
    from router.decision.stages import Predict

    (work / "router.yaml").write_text("{}\n")
    engines = {v: RoutingEngine(load_settings(work / "router.yaml", model_uri="", db_path=work / "d.db",
                                              tenants={"bench": {}}, replay_speed=1e-6,
                                              admission={"enabled": v != "off"}))
               for v in ("off", "on", "before")}
    stages = engines["before"].route_stages
    stages[next(i for i, s in enumerate(stages) if isinstance(s, Predict))] = _predict_before(engines["before"])
    return engines


def _predict_before(engine: Any) -> Any:
    """The ``predict`` stage as it was (three numpy temporaries: the masks' ``&``, the fancy index,
    ``any``), for the before/after comparison."""
    from envs import kernels as env_kernels
    from router.decision.stages import Predict
    from xroute.admission_rules import ADMIT, verdict

    class _PredictBefore(Predict):
        def apply(self, d: Any) -> None:
            e = self.engine
            if not e.admission_on or d.trace is not None:
                return
            ok = d.env_mask & d.allowed
            ttft = e.env.C[env_kernels.TTFT]
            best = d.best_ttft_ms = float(ttft[: ok.shape[0]][ok].min()) if ok.any() else float("inf")
            band = e.band_of(d.req, d.tenant)
            slo = float(d.req.ttft_ms)
            v = verdict(band, best, slo, d.waited_ms)
            if v != ADMIT:
                raise e.unattainable(v, band, best, slo - d.waited_ms)

    return _PredictBefore(engine)


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
    predict: dict[str, list[float]] = {"on": [], "before": []}
    for v, ts in predict.items():
        engines[v].stage_timer = lambda name, s, ts=ts: ts.append(s) if name == "predict" else None
    who = Principal("bench", "tenant", "k")
    origins = engines["off"].origins
    reqs = [RouteRequest.model_validate({"origin": origins[i % len(origins)], "input_tokens": 200 + (i * 37) % 1800,
                                         "max_output_tokens": 10 + (i * 13) % 40, "ttft_ms": 2000, "tpot_ms": 100,
                                         "priority": ("critical", "standard")[i % 2]})
            for i in range(n)]
    wall0 = engines["off"].source.start_wall
    rates: dict[str, list[float]] = {"off": [], "on": [], "before": []}
    order = ["off", "on", "before"]
    for r in range(rounds):
        for v in order[r % 3:] + order[: r % 3]:
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
            "before_per_s": round(float(np.median(rates["before"]))),
            "predict_stage": _pct(predict["on"][len(predict["on"]) // 10:]),
            "predict_stage_before": _pct(predict["before"][len(predict["before"]) // 10:])}


def _ample_serving(work: Path) -> Path:
    """The shipped service model with every ``max_concurrency`` x1000: no pool fills under wrk."""
    text = (REPO / "configs" / "serving.yaml").read_text()
    out = work / "serving-ample.yaml"
    out.write_text(re.sub(r"max_concurrency: (\d+)", lambda m: f"max_concurrency: {int(m.group(1)) * 1000}", text))
    return out


def _admission_counts(srv: Any, admin: str) -> dict[str, float]:
    """The server's ``xroute_router_admission_total`` by band and outcome (empty: nothing judged)."""
    import httpx

    page = httpx.get(srv.url.replace("/v1/route", "/metrics"), headers={"Authorization": f"Bearer {admin}"},
                     timeout=10).text
    return {f"{m.group(1)}:{m.group(2)}": float(m.group(3)) for m in re.finditer(
        r'xroute_router_admission_total\{band="([^"]*)",outcome="([^"]*)"\} (\S+)', page)}


def bench_http(work: Path, seconds: float, rounds: int) -> dict[str, Any]:
    """``POST /v1/route`` with admission off and on (module docstring, 3)."""
    import bench_router as br

    from router.control.keys import add_key

    key = add_key(work / "keys.json", "bench")
    admin = add_key(work / "keys.json", "ops", "admin")
    (work / "none.yaml").write_text("{}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "XROUTE_ROUTER_CONFIG": str(work / "none.yaml"),
           "XROUTE_ROUTER_ENV__SERVING_CONFIG": str(_ample_serving(work))}
    variants = {"off": {}, "on": {"XROUTE_ROUTER_ADMISSION__ENABLED": "true"}}
    ref = br._Server.simple(work, "trivial", "auto", env)
    servers: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        ref.warm_up()
        for v, extra in variants.items():
            servers[v] = br._Server.route(work, None, "", key, {**env, **extra}, f"admission-{v}")
            servers[v].warm_up()
        for r in range(rounds):
            for v in (("off", "on") if r % 2 == 0 else ("on", "off")):
                runs[v].append(br.paired_run(ref, servers[v], seconds, f"round {r + 1}/{rounds} {v}"))
        judged = _admission_counts(servers["on"], admin)
    finally:
        ref.stop()
        for srv in servers.values():
            srv.stop()
    out: dict[str, Any] = {v: br._median_of(runs[v]) for v in variants}
    ratios = [x["vs_trivial"] / y["vs_trivial"] for x, y in zip(runs["on"], runs["off"])]
    cpu = [x.get("server_cpu_us_per_req", np.nan) - y.get("server_cpu_us_per_req", np.nan)
           for x, y in zip(runs["on"], runs["off"])]
    out["on_vs_off"] = {"median": round(float(np.median(ratios)), 3), "min": round(min(ratios), 3),
                        "max": round(max(ratios), 3), "server_cpu_us_per_req_added": round(float(np.nanmedian(cpu)), 1)}
    out["admission_total_on"] = judged  # (queued/shed absent: nothing waited)
    return out


def _http_part(res: dict[str, Any], seconds: float, rounds: int) -> None:
    if shutil.which("wrk") is None:
        res["http"] = {"skipped": "wrk not found: sudo apt-get install wrk"}
        return
    work = Path(tempfile.mkdtemp(prefix="xroute-bench-admission-http-"))
    try:
        res["http"] = bench_http(work, seconds, rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _http_table(http: dict[str, Any]) -> list[str]:
    if "skipped" in http:
        return ["", f"HTTP: {http['skipped']}"]
    lines = ["", "| POST /v1/route (wrk) | req/s | p99 ms | server CPU us/req | of trivial | non-2xx |",
             "|---|---|---|---|---|---|"]
    for v in ("off", "on"):
        m = http[v]
        lines.append(f"| admission {v} | {m['rps']} | {m['p99_ms']} | {m.get('server_cpu_us_per_req')} | "
                     f"{m['vs_trivial']} | {m['non_2xx']} |")
    x = http["on_vs_off"]
    lines.append(f"\non/off (median of the rounds' paired ratios): {x['median']} ({x['min']}-{x['max']}), "
                 f"+{x['server_cpu_us_per_req_added']} us server CPU per request; target >= 0.9. "
                 f"Admission outcomes on the on server: {http['admission_total_on'] or 'none'}")
    return lines


def table(res: dict[str, Any]) -> str:
    d, q = res["decide"], res["queue"]
    p = d["predict_stage"]
    lines = [f"Admission ({res['cpus']} CPUs, {res['python']}, {res['rounds']} rounds of {res['n']} decisions)", "",
             "| measure | p50 | p99 | target |", "|---|---|---|---|",
             f"| predict stage (in each ranking) | {p['p50_us']} us | {p['p99_us']} us | |",
             f"| predict stage before its compiled best (same run) | {d['predict_stage_before']['p50_us']} us | "
             f"{d['predict_stage_before']['p99_us']} us | |",
             f"| queue bookkeeping (a waiting request) | {q['p50_us']} us | {q['p99_us']} us | |",
             f"| admission's own cost (sum of the p99s) | | {res['admission_p99_us']} us | <= 20 us |", "",
             "| decisions/s (decide, embedded state) | off | on | on/off (median, range) | target |",
             "|---|---|---|---|---|",
             f"| shipped bundle, greedy | {d['off_per_s']} | {d['on_per_s']} | {d['ratio_median']} "
             f"({d['ratio_range'][0]}-{d['ratio_range'][1]}) | >= 0.9 |"]
    if "http" in res:
        lines += _http_table(res["http"])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="decisions per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--http", action="store_true", help="also POST /v1/route with admission off and on (wrk)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of wrk per HTTP run")
    ap.add_argument("--http-rounds", type=int, default=5, help="HTTP rounds (each: off and on, paired)")
    a = ap.parse_args()
    res: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "n": a.n, "rounds": a.rounds}
    res["queue"] = bench_queue(50_000)
    res["decide"] = bench_decide(a.n, a.rounds)
    res["admission_p99_us"] = round(res["decide"]["predict_stage"]["p99_us"] + res["queue"]["p99_us"], 2)
    if a.http:
        _http_part(res, a.duration, a.http_rounds)
    out = REPO / "benchmarks" / "results" / "admission.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
