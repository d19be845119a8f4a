"""Router benchmarks, side by side in one run (results: ``docs/results.md``, "Router").

1. In-process decision at 100 offerings (synthetic catalog) and on the shipped bundle: the
   environment's live features -> constraint mask -> policy -> masked argmax -> load update
   (``features->argmax``; ``set_live``, plus the observation when the policy reads features), and
   the whole ``RoutingEngine.decide`` (plus response JSON and the log row), for the greedy
   fallback and for a learned scorer of the DQN's default shape.
2. HTTP, one uvicorn worker each (same settings: uvloop + httptools when installed), ``wrk`` on
   loopback, 10 connections, one wrk thread. Every row is measured right after a run of a trivial
   async FastAPI POST endpoint on the same stack (its pair; the reference servers stay up for the
   whole run) and its ratio is against that run, so the machine's drift over the run does not bias
   the ratios. Rows: a bare numpy routing decision endpoint; ``POST /v1/route`` of ``xroute serve``
   (auth, tenant + request masks, env features, policy, group-committed decision log with
   ``synchronous=FULL``, access log, metrics) with its default settings and the greedy fallback
   (``route``), with a learned scorer of the DQN's default shape (``route_learned``) and with the
   same structure 4 wide (``route_learned_tiny``: what the learned path costs apart from its
   network) -- these three get ``--rounds`` pairs each (servers up throughout, order rotated),
   reported as medians with the range of the ratios --; then one pair each with one setting
   changed: ``synchronous=NORMAL`` and answers stored uncompressed; and ``/v1/route`` (same app and settings) on uvicorn's pure-Python stack
   (asyncio + h11, what uvicorn runs without the [serve] extra), against the trivial endpoint on
   that stack.
   Ablations, to show where a request's time goes (the same app, one part replaced in the
   serving process only): a bare ASGI app answering a body the size of a route answer
   (``bare_asgi``: uvicorn's own cost), ``/v1/route`` answering a constant instead of deciding
   (``route_front_only``: request id, trace, key, validation, access line, the answer's write), and
   ``/v1/route`` deciding but not writing the decision log (``route_no_log``).
3. Soak: ``/v1/route`` (greedy) under wrk for ``--soak-s`` seconds (default 300), right after the
   headline rounds, RSS at start and end; every ``SOAK_WINDOW_S`` seconds the server's ``/metrics``
   is read, and each window reports its decisions/s, the share of in-server route times over 10 ms,
   the checkpoints run between commits (how many, mean, share over 10 ms) and the log's size.

4. ``--ope-ab`` (alone, instead of the above): what off-policy evaluation's logging costs, side by
   side -- each decision's action set, features and propensity logged (``log_features``, the
   default), not logged, and logged with the tenant exploring (``explore_epsilon`` 0.1): in process
   (``RoutingEngine.decide`` on the shipped bundle, greedy and a learned scorer; ``--rounds``
   interleaved rounds, medians of their p50/p99) and over HTTP (``POST /v1/route``, ``--rounds``
   rounds in rotated order, each run paired with the trivial endpoint; medians), with the bytes a
   decision takes in the log.

5. ``--against DIR`` (alone): this checkout against another one (``DIR``, e.g. ``git worktree add
   /tmp/base main``) side by side -- in process, ``RoutingEngine.decide`` on the shipped bundle
   (greedy and a learned scorer of the DQN's default shape), ``--rounds`` rounds alternating the
   checkouts, each a process of that checkout's own code; medians of the rounds' p50/p99 -- and
   ``POST /v1/route`` served by each checkout's code, the servers up throughout, ``--rounds`` rounds
   in rotated order, every run paired with the trivial endpoint; medians, with the server's and
   its log writer's CPU a request and the bytes a decision took in the log.

Usage::

    sudo apt-get install wrk            # wrk 4.x; the HTTP parts are skipped without it
    .venv/bin/python benchmarks/bench_router.py                  # everything (~25 min)
    .venv/bin/python benchmarks/bench_router.py --soak-s 0 --duration 10   # no soak (~9 min)
    .venv/bin/python benchmarks/bench_router.py --ope-ab --duration 10     # OPE logging on vs off (~6 min)
    .venv/bin/python benchmarks/bench_router.py --against /tmp/base --duration 10  # this vs another checkout (~5 min)

Writes ``benchmarks/results/router.json`` (``router_ope.json`` with ``--ope-ab``, ``router_against.json``
with ``--against``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from fastapi import FastAPI, Request

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.servers import free_port  # noqa: E402

ORIGINS_LUA = "{%s}"


# ---------------------------------------------------------------------------------------- data
def make_bundle(root: Path, n_offerings: int = 100, n_requests: int = 4000, seed: int = 0) -> Path:
    """A synthetic bundle with ``n_offerings`` offerings over 10 regions and 5 accelerators."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    clouds = ["aws", "azure", "gcp"]  # schema-valid provider names (the router never looks at them)
    accs = [("A10G", 1.0), ("L4", 0.8), ("T4", 0.55), ("A100", 3.7), ("H100", 6.9)]
    n_loc = max(1, -(-n_offerings // (2 * len(accs))))
    locs = [f"{clouds[i % 3]}:region-{i}" for i in range(n_loc)]
    rows: list[dict[str, Any]] = []
    for loc in locs:
        p, r = loc.split(":")
        for acc, price in accs:
            for mode in ("on_demand", "spot"):
                if len(rows) < n_offerings:
                    rows.append({"offering_id": f"{loc}:{acc.lower()}-x1:{mode}", "provider": p, "region": r,
                                 "zone": "", "instance_type": f"{acc.lower()}-x1", "accelerator": acc,
                                 "accelerator_count": 1, "vcpus": 8, "memory_gib": 32, "pricing_mode": mode,
                                 "capacity_replicas": 2,
                                 "_p": price * (0.35 if mode == "spot" else 1.0) * rng.uniform(0.9, 1.1)})
    off = pd.DataFrame(rows)
    off.drop(columns="_p").to_csv(root / "offerings.csv", index=False)
    t0 = pd.Timestamp("2024-01-01T00:00:00Z")
    prices = [{"ts": (t0 - pd.Timedelta("1D") + pd.Timedelta(hours=h)).isoformat(), "offering_id": o,
               "usd_per_hour": p * rng.uniform(0.9, 1.1)} for o, p in zip(off.offering_id, off._p) for h in range(0, 48, 6)]
    pd.DataFrame(prices).sort_values(["offering_id", "ts"]).to_csv(root / "prices.csv", index=False)
    xy = rng.uniform(0, 1, (len(locs), 2))
    pd.DataFrame([{"src": a, "dst": b, "rtt_ms": 2.0 if a == b else float(5 + 250 * np.hypot(*(xy[i] - xy[j])))}
                  for i, a in enumerate(locs) for j, b in enumerate(locs)]).to_csv(root / "rtt.csv", index=False)
    ts = t0 + pd.to_timedelta(np.cumsum(rng.exponential(0.5, n_requests)), unit="s")
    out = rng.integers(5, 300, n_requests)
    pd.DataFrame({"ts": [t.isoformat() for t in ts], "request_id": [f"r{i:06d}" for i in range(n_requests)],
                  "origin": rng.choice(locs, n_requests), "input_tokens": rng.integers(50, 4000, n_requests),
                  "max_output_tokens": 512, "ttft_ms": 2500.0, "tpot_ms": 100.0,
                  "output_tokens": out}).to_csv(root / "workload.csv", index=False)
    spot = [o for o in off.offering_id if o.endswith(":spot")]
    av = []
    for k, oid in enumerate(spot):
        av.append({"ts": (t0 - pd.Timedelta("1h")).isoformat(), "offering_id": oid, "available": 1})
        down = 300 + 97 * k
        av.append({"ts": (t0 + pd.Timedelta(seconds=down)).isoformat(), "offering_id": oid, "available": 0})
        av.append({"ts": (t0 + pd.Timedelta(seconds=down + 120)).isoformat(), "offering_id": oid, "available": 1})
    pd.DataFrame(av).sort_values(["offering_id", "ts"]).to_csv(root / "availability.csv", index=False)
    return root


def learned_export(root: Path, hidden: int = 64, context: int = 16) -> Path | None:
    """A random-weight export of the DQN's default shape (hidden 64x64, context 16, reward prior),
    or of the same structure with other widths."""
    try:
        from models.policy import RewardPrior, RouterWeights, save_router
    except ImportError:
        return None
    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
    from xroute.config import EnvConfig

    rng = np.random.default_rng(0)
    d = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    dims = [d + context, hidden, hidden, 1]
    layers = [(rng.normal(0, 0.1, (a, b)).astype(np.float32), np.zeros(b, np.float32)) for a, b in itertools.pairwise(dims)]
    ctx = (rng.normal(0, 0.1, (d, context)).astype(np.float32), np.zeros(context, np.float32))
    return save_router(RouterWeights(layers=layers, ctx=ctx, prior=RewardPrior.from_env_config(EnvConfig())), root)


# ---------------------------------------------------------------------------------------- in-process
def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 1), "p99_us": round(float(np.percentile(a, 99)), 1),
            "mean_us": round(float(a.mean()), 1)}


def bench_inprocess(bundle: Path, model: Path | None, n: int = 20000) -> dict[str, Any]:
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine
    from router.decision.model_slot import ActivePolicy
    from tests.state_support import decide
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    empty = Path(tempfile.mkdtemp()) / "router.yaml"
    empty.write_text("{}\n")
    out: dict[str, Any] = {}
    policies: list[tuple[str, Any]] = [("greedy", None)]
    if model is not None:
        from models.loader import load_policy

        policies.append(("learned", load_policy(str(model))))
    for label, policy in policies:
        eng = RoutingEngine(load_settings(empty, telemetry=bundle, model_uri="", max_telemetry_age_s=1e9,
                                          tenants={"bench": {}}))
        if policy is not None:
            policy.reset(eng.env, 0)
            eng.slot.install(ActivePolicy.make(policy, "learned", "model", "bench", str(model)))
        env = eng.env
        who = Principal("bench", "tenant", "k")
        origins = eng.origins
        reqs = [RouteRequest(origin=origins[i % len(origins)], input_tokens=200 + (i * 37) % 1800,
                             max_output_tokens=10 + (i * 13) % 60, ttft_ms=2000.0, tpot_ms=100.0) for i in range(256)]
        constrained = RouteRequest(origin=origins[0], input_tokens=500, max_output_tokens=30, ttft_ms=2000.0, tpot_ms=100.0,
                                   constraints={"deny": [{"pricing_modes": ["spot"]}]})
        active, _ = eng.slot.current(False)
        wall0 = eng.source.start_wall  # type: ignore[attr-defined]  # the replay source of a bundle
        core: list[float] = []
        full: list[float] = []
        # requests 20 ms apart in telemetry time (50 req/s): pools see load but do not saturate
        for i in range(n):
            wall = wall0 + 0.02 * i
            r = reqs[i % 256]
            t0 = time.perf_counter()
            t = eng.now(wall)
            valid = env.set_live(t, r.origin, r.input_tokens, r.max_output_tokens, r.ttft_ms, r.tpot_ms, None, None,
                                 "bench", i)
            a = eng._choose(active, valid)[0]  # builds the features when the policy reads them
            env.commit_live(a)
            core.append(time.perf_counter() - t0)
        for i in range(n):
            wall = wall0 + 0.02 * (n + i)
            r = constrained if i % 4 == 0 else reqs[i % 256]
            t0 = time.perf_counter()
            decide(eng, r, who, f"d_{i}", wall)
            full.append(time.perf_counter() - t0)
        skip = min(1000, n // 10)  # the first decisions warm caches and compile: not measured
        out[label] = {"offerings": env.n, "features_to_argmax": _pct(core[skip:]), "engine_decide": _pct(full[skip:])}
    return out


#: the OPE logging variants: label -> router settings through the environment (``--ope-ab``)
OPE_VARIANTS = {"features_off": {"XROUTE_ROUTER_LOG_FEATURES": "false"},
                "features_on": {},
                "features_on_explore": {"XROUTE_ROUTER_TENANTS": json.dumps({"bench": {"explore_epsilon": 0.1}})}}


def bench_ope_inprocess(bundle: Path, model: Path | None, n: int, rounds: int) -> dict[str, Any]:
    """``RoutingEngine.decide`` with each of :data:`OPE_VARIANTS`' settings, greedy and learned:
    ``rounds`` rounds of ``n`` decisions per engine, the engines interleaved within each round;
    the medians of the rounds' p50 and p99."""
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine
    from router.decision.model_slot import ActivePolicy
    from tests.state_support import decide
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    empty = Path(tempfile.mkdtemp()) / "router.yaml"
    empty.write_text("{}\n")
    flags = {"features_off": {"log_features": False}, "features_on": {},
             "features_on_explore": {"tenants": {"bench": {"explore_epsilon": 0.1}}}}
    out: dict[str, Any] = {}
    policies: list[tuple[str, Any]] = [("greedy", None)]
    if model is not None:
        from models.loader import load_policy

        policies.append(("learned", load_policy(str(model))))
    who = Principal("bench", "tenant", "k")
    for label, policy in policies:
        engines = {}
        for v, kw in flags.items():
            eng = RoutingEngine(load_settings(empty, telemetry=bundle, model_uri="", max_telemetry_age_s=1e9,
                                              **{"tenants": {"bench": {}}, **kw}))
            if policy is not None:
                policy.reset(eng.env, 0)
                eng.slot.install(ActivePolicy.make(policy, "learned", "model", "bench", str(model)))
            engines[v] = eng
        origins = next(iter(engines.values())).origins
        reqs = [RouteRequest(origin=origins[i % len(origins)], input_tokens=200 + (i * 37) % 1800,
                             max_output_tokens=10 + (i * 13) % 60, ttft_ms=2000.0, tpot_ms=100.0) for i in range(256)]
        p50: dict[str, list[float]] = {v: [] for v in engines}
        p99: dict[str, list[float]] = {v: [] for v in engines}
        blob: dict[str, list[int]] = {v: [] for v in engines}
        for r in range(rounds + 1):  # round 0 warms up (compiles, fills caches): not counted
            for v, eng in engines.items():
                wall0 = eng.source.start_wall + 0.02 * n * r  # type: ignore[attr-defined]
                took = []
                for i in range(n):
                    t0 = time.perf_counter()
                    _, row, _, _ = decide(eng, reqs[i % 256], who, f"d_{r}_{i}", wall0 + 0.02 * i)
                    took.append(time.perf_counter() - t0)
                    if r and i % 100 == 0:
                        blob[v].append(len(row.features) if row.features is not None else 0)
                if r:
                    q = _pct(took)
                    p50[v].append(q["p50_us"])
                    p99[v].append(q["p99_us"])
        out[label] = {v: {"p50_us": float(np.median(p50[v])), "p99_us": float(np.median(p99[v])),
                          "p50_us_rounds": p50[v], "record_bytes": round(float(np.mean(blob[v])), 1),
                          "offerings": engines[v].n} for v in engines}
    return out


def bench_ope_http(work: Path, seconds: float, rounds: int) -> dict[str, Any]:
    """``POST /v1/route`` (greedy, shipped bundle) with each of :data:`OPE_VARIANTS`: the servers
    up throughout, ``rounds`` rounds in rotated order, every run paired with the trivial endpoint;
    medians (:func:`_median_of`), and the bytes each decision took in the log."""
    if shutil.which("wrk") is None:
        return {"skipped": "wrk not found: sudo apt-get install wrk"}
    from router.control.keys import add_key

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    key = add_key(work / "keys.json", "bench")
    variants = {v: (lambda v=v, o=overrides: _Server.route(work, None, "", key, {**env, **o}, f"ope-{v}"))  # type: ignore[misc]
                for v, overrides in OPE_VARIANTS.items()}
    out: dict[str, Any] = {}
    for v, (median, srv) in _rotated_pairs(work, env, variants, seconds, rounds).items():
        out[v] = {**median, **_log_bytes(srv.db), "settings": OPE_VARIANTS[v] or "defaults"}
    return out


def paired_run(ref: _Server, srv: _Server, seconds: float, label: str) -> dict[str, Any]:
    """One run of ``srv`` right after one of the trivial endpoint ``ref`` (so the machine's drift
    does not bias the ratio): ``srv``'s measurement with ``paired_trivial_rps`` and ``vs_trivial``
    added, and a progress line on stderr."""
    base = ref.measure(seconds)
    got = srv.measure(seconds)
    got["paired_trivial_rps"] = base["rps"]
    got["vs_trivial"] = round(got["rps"] / base["rps"], 3)
    print(f"  {label}: {got['rps']} req/s ({got.get('non_2xx', 0)} non-2xx), {got['vs_trivial']} of trivial, "
          f"{got.get('server_cpu_us_per_req')} us CPU/req (+{got.get('children_cpu_us_per_req')} writer)",
          file=sys.stderr, flush=True)
    return got


def _rotated_pairs(work: Path, env: dict[str, str], variants: dict[str, Any], seconds: float, rounds: int
                   ) -> dict[str, tuple[dict[str, Any], _Server]]:
    """Start every variant's server (``variants``: label -> a function starting it) and the trivial
    endpoint, all up throughout; ``rounds`` rounds in rotated order, every run paired with a run of
    the trivial endpoint right before it; each variant's medians (:func:`_median_of`) and server."""
    ref = _Server.simple(work, "trivial", "auto", env)
    servers: dict[str, _Server] = {}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        ref.warm_up()
        for v, start in variants.items():
            servers[v] = start()
            servers[v].warm_up()
        order = list(variants)
        for r in range(rounds):
            for v in order[r % len(order):] + order[: r % len(order)]:
                runs[v].append(paired_run(ref, servers[v], seconds, f"round {r + 1}/{rounds} {v}"))
    finally:
        ref.stop()
        for srv in servers.values():
            srv.stop()
    return {v: (_median_of(runs[v]), servers[v]) for v in variants}


def bench_against_http(work: Path, other: Path, seconds: float, rounds: int) -> dict[str, Any]:
    """``POST /v1/route`` served by this checkout and by ``other`` (each its own code, bundle and
    settings' defaults), greedy and a learned scorer: :func:`_rotated_pairs` (module docstring, 5)."""
    if shutil.which("wrk") is None:
        return {"skipped": "wrk not found: sudo apt-get install wrk"}
    from router.control.keys import add_key

    key = add_key(work / "keys.json", "bench")
    learned = str(learned_export(work / "learned-http") or "")
    trees = {"this": REPO, "against": other.resolve()}
    variants = {f"{tree}_{pol}": (lambda t=t, m=m, label=f"{tree}_{pol}": _Server.route(  # type: ignore[misc]
        work, None, m, key, {**os.environ, "PYTHONPATH": str(t)}, label, cwd=t))
        for tree, t in trees.items() for pol, m in (("greedy", ""), ("learned", learned)) if pol == "greedy" or m}
    out: dict[str, Any] = {"trees": {k: str(v) for k, v in trees.items()}}
    for v, (median, srv) in _rotated_pairs(work, {**os.environ, "PYTHONPATH": str(REPO)}, variants, seconds,
                                           rounds).items():
        out[v] = {**median, **_log_bytes(srv.db)}
    for pol in ("greedy", "learned"):
        if f"this_{pol}" in out:
            out[f"{pol}_this_vs_against"] = round(out[f"this_{pol}"]["vs_trivial"] / out[f"against_{pol}"]["vs_trivial"], 3)
    return out


#: what a checkout's own process runs for ``--against``'s in-process rows: its ``bench_inprocess``
_INPROCESS = ("import json, sys; from pathlib import Path; import benchmarks.bench_router as br; "
              "res = br.bench_inprocess(br.REPO / 'data' / 'bundles' / 'default', Path(sys.argv[1]) if sys.argv[1] "
              "else None, int(sys.argv[2])); print(json.dumps({k: v['engine_decide'] for k, v in res.items()}))")


def bench_against_inprocess(work: Path, other: Path, n: int, rounds: int) -> dict[str, Any]:
    """``engine.decide`` p50/p99 in each checkout's own process, ``rounds`` rounds alternating
    the checkouts (module docstring, 5); medians of the rounds."""
    model = learned_export(work / "learned-inprocess")
    trees = {"this": REPO, "against": other.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            out = subprocess.run([sys.executable, "-c", _INPROCESS, str(model or ""), str(n)], cwd=trees[tree],
                                 env={**os.environ, "PYTHONPATH": str(trees[tree])}, capture_output=True, text=True,
                                 check=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  in process, round {r + 1}/{rounds} {tree}: {runs[tree][-1]}", file=sys.stderr, flush=True)
    return {tree: {pol: {q: float(np.median([run[pol][q] for run in rs])) for q in ("p50_us", "p99_us")}
                   for pol in rs[0]} for tree, rs in runs.items()}


def against_table(res: dict[str, Any]) -> str:
    http = res["http"]
    lines = [f"machine: {res['machine']}; load average {res['load_average_at_start']} -> {res['load_average_at_end']}",
             "", "| engine.decide (shipped bundle, in process) | checkout | p50 us | p99 us |", "|---|---|---:|---:|"]
    for tree, pols in res["inprocess"].items():
        for pol, q in pols.items():
            lines.append(f"| {pol} | {tree} | {q['p50_us']} | {q['p99_us']} |")
    if "skipped" in http:
        return "\n".join([*lines, "", f"HTTP: {http['skipped']}"])
    lines += ["", f"this: {http['trees']['this']}; against: {http['trees']['against']}", "",
              "| POST /v1/route (wrk -c10, one worker) | req/s | vs trivial [range] | server CPU us/req (writer) "
              "| p50 ms | p99 ms | log bytes/decision |", "|---|---:|---:|---:|---:|---:|---:|"]
    for v, x in http.items():
        if isinstance(x, dict) and "rps" in x:
            lines.append(f"| {v} | {x['rps']} | {x['vs_trivial']} [{x['vs_trivial_range'][0]}-"
                         f"{x['vs_trivial_range'][1]}] | {x.get('server_cpu_us_per_req')} "
                         f"({x.get('children_cpu_us_per_req')}) | {x['p50_ms']} | {x['p99_ms']} | "
                         f"{x['log_bytes_per_decision']} |")
    lines += ["", *(f"{k}: {v}" for k, v in http.items() if k.endswith("_this_vs_against"))]
    return "\n".join(lines)


def _log_bytes(db: Path | None) -> dict[str, Any]:
    """What a decision took in the SQLite log: its rows, the mean stored OPE record and answer, and
    the file (database + WAL) per decision."""
    import sqlite3

    if db is None or not db.exists():
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        n, feat, answer = conn.execute("SELECT COUNT(*), AVG(COALESCE(LENGTH(features), 0)), AVG(LENGTH(response_json)) "
                                       "FROM decisions").fetchone()
        explored = conn.execute("SELECT AVG(propensity < 0.5) FROM decisions WHERE epsilon > 0").fetchone()[0]
    finally:
        conn.close()
    files = sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))
    return {"decisions_logged": n, "record_bytes": round(feat or 0, 1), "answer_bytes": round(answer or 0, 1),
            "log_bytes_per_decision": round(files / max(n, 1), 1),
            "explored_share": None if explored is None else round(float(explored), 4)}


def ope_table(res: dict[str, Any]) -> str:
    lines = [f"machine: {res['machine']}; load average {res['load_average_at_start']} -> {res['load_average_at_end']}",
             "", "| engine.decide (shipped bundle) | variant | p50 us | p99 us | stored record bytes (raw) |",
             "|---|---|---:|---:|---:|"]
    for pol, vs in res["inprocess"].items():
        for v, x in vs.items():
            lines.append(f"| {pol} | {v} | {x['p50_us']} | {x['p99_us']} | {x['record_bytes']} |")
    http = res["http"]
    if "skipped" in http:
        return "\n".join([*lines, "", f"HTTP: {http['skipped']}"])
    lines += ["", "| POST /v1/route (wrk -c10, one worker, greedy) | req/s | vs trivial [range] | server CPU us/req "
              "(writer) | p50 ms | p99 ms | record / answer bytes stored | log bytes/decision |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v, x in http.items():
        lines.append(f"| {v} | {x['rps']} | {x['vs_trivial']} [{x['vs_trivial_range'][0]}-{x['vs_trivial_range'][1]}] "
                     f"| {x.get('server_cpu_us_per_req')} ({x.get('children_cpu_us_per_req')}) | {x['p50_ms']} | "
                     f"{x['p99_ms']} | {x['record_bytes']} / {x['answer_bytes']} | {x['log_bytes_per_decision']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- HTTP apps
def trivial_app() -> Any:
    app = FastAPI()

    @app.post("/trivial")
    async def trivial() -> dict[str, bool]:
        return {"ok": True}

    return app


def numpy_app() -> Any:
    """The bare numpy routing decision: features of 100 offerings, a dot product, argmax."""
    rng = np.random.default_rng(0)
    feats = rng.random((100, 23)).astype(np.float32)
    w = rng.random(23).astype(np.float32)

    app = FastAPI()

    @app.post("/decide")
    async def decide(request: Request) -> dict[str, int]:
        body = await request.json()
        x = feats * np.float32(body.get("input_tokens", 1) / 1000.0)
        return {"offering": int(np.argmax(x @ w))}

    return app


#: uvicorn's event loop and HTTP parser: "auto" picks uvloop and httptools when installed (the
#: [serve] extra; what ``xroute serve`` runs), "pure" forces the pure-Python asyncio + h11
STACKS: dict[str, tuple[Any, Any]] = {"auto": ("auto", "auto"), "pure": ("asyncio", "h11")}


#: the size of a typical ``/v1/route`` answer (three alternatives), for the ablations' constant bodies
ANSWER_BYTES = 1300


def bare_app() -> Any:
    """A bare ASGI app (no framework): reads the body, answers ``ANSWER_BYTES`` of JSON."""
    body = b'{"ok":"' + b"x" * (ANSWER_BYTES - 9) + b'"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _stub(part: str) -> None:
    """Replace one part of the router in this (serving) process, for the ablation rows:
    ``decision`` -> the fast path answers a constant of ``ANSWER_BYTES`` without deciding or
    logging; ``log`` -> decisions are made but never written (the log's future is already done)."""
    import asyncio

    from router.api import route
    from router.store import sqlite as store

    if part == "decision":
        answer = b'{"decision_id":"d_0","padding":"' + b"x" * (ANSWER_BYTES - 34) + b'"}'

        async def constant(svc: Any, body: Any, who: Any, state: Any, idempotency: Any = None) -> bytes:
            return answer

        route.route_decision = constant  # type: ignore[assignment]
    elif part == "log":
        def not_written(self: Any, row: tuple[Any, ...]) -> Any:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(0)
            return fut

        store.DecisionStore.record_decision = not_written  # type: ignore[method-assign]


def _serve_app(kind: str, port: int, stack: str = "auto", stub: str | None = None) -> None:
    import uvicorn

    if kind == "route":  # the router's app as ``xroute serve`` builds it, settings from XROUTE_ROUTER_*
        from router.app.factory import create_app
        from router.core.settings import load_settings
        from router.decision.engine import RoutingEngine

        if stub:
            _stub(stub)
        settings = load_settings(None)
        loop, http = STACKS[stack]
        app = create_app(settings, RoutingEngine(settings))
        uvicorn.run(app, host="127.0.0.1", port=port, log_config=None, access_log=False, server_header=False,
                    loop=loop, http=http)
        return
    app = {"trivial": trivial_app, "numpy": numpy_app, "bare": bare_app}[kind]()
    # the same server settings as ``xroute serve`` (router/app/cli.py): no uvicorn access log, no server header
    loop, http = STACKS[stack]
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, server_header=False,
                loop=loop, http=http)


def server_stack() -> dict[str, str]:
    """What uvicorn's "auto" picks here, for the trivial apps and ``xroute serve`` alike."""
    import importlib.util

    return {"loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
            "http": "httptools" if importlib.util.find_spec("httptools") else "h11"}


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(url)


def _children_rss_kib(pid: int) -> int:
    """RSS of the server's child processes (the decision-log writer)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            total += max(_rss_kib(int(c)), 0)
    return total


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)$", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def proc_stat(pid: int) -> tuple[str, float]:
    """Process ``pid``'s name and the CPU seconds (user + system) it used so far, from /proc."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw.rpartition(")")[2].split()
    return raw[raw.index("(") + 1: raw.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (every thread's), from /proc."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by process ``pid`` and by its child processes
    (the decision-log writer), from /proc."""
    return proc_stat(pid)[1], sum(proc_stat(c)[1] for c in child_pids(pid))


def run_wrk(url: str, script: Path, seconds: float, connections: int = 10, pid: int | None = None) -> dict[str, Any]:
    """wrk against ``url``; with ``pid`` (the server), also the CPU time the server and its child
    processes used per request during the run: the event loop's cost of a request, which unlike
    req/s does not move when the load generator gets more or less of the shared cores."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{int(seconds)}s", "--latency", "-s", str(script), url]
    cpu0 = _cpu_s(pid) if pid is not None else None
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu1 = _cpu_s(pid) if pid is not None else None
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = {p: _ms(re.search(rf"^\s+{p}%\s+(\S+)", out, re.M).group(1)) for p in ("50", "99")}  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    res: dict[str, Any] = {"rps": round(rps, 1), "p50_ms": round(lat["50"], 3), "p99_ms": round(lat["99"], 3),
                           "requests": total, "non_2xx": int(non2xx.group(1)) if non2xx else 0,
                           "socket_errors": errors.group(1) if errors else ""}
    if cpu0 is not None and cpu1 is not None and total:
        res["server_cpu_us_per_req"] = round((cpu1[0] - cpu0[0]) / total * 1e6, 1)
        res["children_cpu_us_per_req"] = round((cpu1[1] - cpu0[1]) / total * 1e6, 1)
    return res


def _lua(path: Path, target: str, key: str = "", origins: list[str] | None = None) -> Path:
    if target == "route":
        assert origins
        lua = (
            "local origins = {" + ", ".join(f'"{o}"' for o in origins) + "}\n"
            "local i = 0\n"
            'wrk.method = "POST"\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
            f'wrk.headers["Authorization"] = "Bearer {key}"\n'
            "request = function()\n"
            "  i = i + 1\n"
            "  local o = origins[(i % #origins) + 1]\n"
            '  local body = string.format(\'{"origin":"%s","input_tokens":%d,"max_output_tokens":%d,"ttft_ms":2000,"tpot_ms":100}\','
            " o, 200 + (i * 37) % 1800, 10 + (i * 13) % 40)\n"
            "  return wrk.format(nil, nil, nil, body)\n"
            "end\n")
    else:
        lua = ('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
               'wrk.body = \'{"origin":"aws:us-east-1","input_tokens":500,"max_output_tokens":30,"ttft_ms":2000,"tpot_ms":100}\'\n')
    path.write_text(lua)
    return path


def bench_http(work: Path, bundle: Path | None, seconds: float, soak_s: float, model: str,
               rounds: int = 3) -> dict[str, Any]:
    """Every row is measured right after a run of the trivial endpoint on the same stack (its
    *pair*; both reference servers stay up for the whole run) and its ratio is against that run,
    so drift of the shared machine over the run (~25 minutes) does not bias the ratios. The headline rows
    (``route``, ``route_learned``, ``route_learned_tiny``) get ``rounds`` pairs each, their servers
    up throughout and their order rotated each round; their figures are medians over the rounds."""
    if shutil.which("wrk") is None:
        return {"skipped": "wrk not found: sudo apt-get install wrk"}
    from router.control.keys import add_key

    results: dict[str, Any] = {}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    refs: dict[str, _Server] = {}
    reference_runs: dict[str, list[dict[str, Any]]] = {"auto": [], "pure": []}

    def paired(server: _Server, stack: str = "auto") -> dict[str, Any]:
        ref = refs[stack].measure(seconds)
        reference_runs[stack].append(ref)
        out = server.measure(seconds)
        out["paired_trivial_rps"] = ref["rps"]
        out["vs_trivial"] = round(out["rps"] / ref["rps"], 3)
        return out

    try:
        for stack in ("auto", "pure"):
            refs[stack] = _Server.simple(work, "trivial", stack, env)
            refs[stack].warm_up()
        for label, kind, path in (("numpy", "numpy", "/decide"), ("bare_asgi", "bare", "/")):
            with _Server.simple(work, kind, "auto", env, path) as srv:
                srv.warm_up()
                results[label] = paired(srv)

        keys = work / "keys.json"
        key = add_key(keys, "bench")
        admin_key = add_key(keys, "bench-ops", "admin")  # the soak reads /metrics
        learned = str(learned_export(work / "learned-http") or "")
        # the learned path with a near-free network (4 wide, context 2): what it costs apart from the network
        tiny = str(learned_export(work / "learned-tiny", hidden=4, context=2) or "")
        headline = [(label, m) for label, m in (("route", model), ("route_learned", learned),
                                                  ("route_learned_tiny", tiny)) if label == "route" or m]
        servers: dict[str, _Server] = {}
        try:
            for label, m in headline:
                servers[label] = _Server.route(work, bundle, m, key, env, label)
                servers[label].warm_up()
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in headline}
            for r in range(rounds):
                for label, _ in headline[r % len(headline):] + headline[: r % len(headline)]:
                    runs[label].append(paired(servers[label]))
                    print(f"  round {r + 1}/{rounds} {label}: {runs[label][-1]['rps']} req/s, "
                          f"{runs[label][-1]['vs_trivial']} of trivial", file=sys.stderr, flush=True)
            for label, _ in headline:
                results[label] = {**_median_of(runs[label]), **servers[label].about()}
            if soak_s > 0:
                results["soak"] = servers["route"].soak(soak_s, admin_key)
        finally:
            for srv in servers.values():
                srv.stop()

        # one setting changed each, the pure-Python stack, the ablations: one pair each
        variants: list[tuple[str, dict[str, str], str]] = [
            ("route_normal", {"XROUTE_ROUTER_DB_SYNCHRONOUS": "NORMAL"}, model),
            ("route_uncompressed", {"XROUTE_ROUTER_DB_COMPRESS": "false"}, model),
            ("route_front_only", {}, model),
            ("route_no_log", {}, model),
            ("route_pure_stack", {}, model),
        ]
        for label, overrides, m in variants:
            with _Server.route(work, bundle, m, key, {**env, **overrides}, label) as srv:
                srv.warm_up()
                results[label] = {**paired(srv, "pure" if label == "route_pure_stack" else "auto"), **srv.about()}
                results[label]["settings"] = overrides or "defaults (FULL, writer process, compressed log)"
    finally:
        for ref in refs.values():
            ref.stop()
    results["trivial"] = {**_median_of(reference_runs["auto"]), "settings": "the pairs' reference runs (medians)"}
    results["trivial_pure_stack"] = {**_median_of(reference_runs["pure"]), "settings": "as trivial, asyncio + h11"}
    for label, text in (("route", "defaults (FULL, writer process, compressed log)"),
                        ("route_learned", "defaults (FULL, writer process, compressed log)"),
                        ("route_learned_tiny", "defaults, a learned scorer 4 wide with context 2 (the network nearly free)")):
        if label in results:
            results[label]["settings"] = text
    results["route_pure_stack"]["settings"] = "defaults, uvicorn on asyncio + h11 (against trivial on that stack)"
    for label in _ABLATIONS:
        results[label]["settings"] = f"ablation: {_ABLATIONS[label][1]}"
    for label, v in list(results.items()):
        if isinstance(v, dict) and "vs_trivial" in v:
            results[f"{label}_vs_trivial"] = v["vs_trivial"]
    return results


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one row -> its medians (req/s, latency, CPU, ratio), the worst p99, and every run."""
    def med(key: str) -> float | None:
        xs = [r[key] for r in runs if r.get(key) is not None]
        return round(float(np.median(xs)), 3) if xs else None

    out: dict[str, Any] = {k: med(k) for k in ("rps", "p50_ms", "p99_ms", "server_cpu_us_per_req",
                                                "children_cpu_us_per_req", "redis_cpu_us_per_req", "vs_trivial")}
    out["p99_ms_max"] = max(r["p99_ms"] for r in runs)
    out["non_2xx"] = sum(r["non_2xx"] for r in runs)
    if runs and "vs_trivial" in runs[0]:
        out["vs_trivial_range"] = [min(r["vs_trivial"] for r in runs), max(r["vs_trivial"] for r in runs)]
    out["runs"] = runs
    return {k: v for k, v in out.items() if v is not None}


#: ablation rows: label -> (the part replaced, what the row measures)
_ABLATIONS = {"route_front_only": ("decision", "a constant answer instead of the decision and the log"),
              "route_no_log": ("log", "decides, but the decision log is not written")}


class _Server:
    """One server process under test: started, warmed up, measured with wrk, stopped."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, script: Path, log: Any = None,
                 db: Path | None = None, policy: str | None = None):
        self.proc, self.url, self.script, self.log, self.db, self.policy = proc, url, script, log, db, policy

    @classmethod
    def simple(cls, work: Path, kind: str, stack: str, env: dict[str, str], path: str = "/trivial") -> _Server:
        """One of the comparison apps (``trivial``, ``numpy``, ``bare``) on ``stack``."""
        port = free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--stack", stack, "--port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(f"http://127.0.0.1:{port}/", proc)
        except BaseException:
            proc.kill()
            raise
        return cls(proc, f"http://127.0.0.1:{port}{path}", _lua(work / f"{kind}.lua", kind))

    @classmethod
    def route(cls, work: Path, bundle: Path | None, model: str, key: str, env: dict[str, str], label: str,
              extra: list[str] | None = None, cwd: Path = REPO) -> _Server:
        """``xroute serve`` with ``env``'s settings and ``extra`` options (or, for the pure stack
        and the ablations, the same app served by this script), run in ``cwd`` (a checkout)."""
        import httpx

        port = free_port()
        db = work / f"decisions-{label}.db"
        env = {"XROUTE_ROUTER_TENANTS": json.dumps({"bench": {}}), **env}  # the key's tenant, declared
        args = [sys.executable, "-m", "xroute_app", "serve", "--port", str(port), "--db", str(db),
                "--keys-file", str(work / "keys.json"), "--model", model, *(extra or [])]
        if bundle is not None:
            args += ["--telemetry", str(bundle)]
        if label == "route_pure_stack" or label in _ABLATIONS:  # the same app and settings, served by uvicorn
            # on asyncio + h11, or with one part replaced
            args = [sys.executable, __file__, "--serve", "route", "--port", str(port)]
            args += ["--stack", "pure"] if label == "route_pure_stack" else ["--stub", _ABLATIONS[label][0]]
            env = {**env, "XROUTE_ROUTER_DB_PATH": str(db), "XROUTE_ROUTER_KEYS_FILE": str(work / "keys.json"),
                   "XROUTE_ROUTER_MODEL_URI": model}
            if bundle is not None:
                env["XROUTE_ROUTER_TELEMETRY"] = str(bundle)
        log = open(work / f"router-{label}.log", "wb")
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=log)
        try:
            _wait_ready(f"http://127.0.0.1:{port}/healthz", proc)
            origins = httpx.get(f"http://127.0.0.1:{port}/v1/offerings",
                                headers={"Authorization": f"Bearer {key}"}).json()["origins"]
            policy = httpx.get(f"http://127.0.0.1:{port}/readyz").json()["policy"]
        except BaseException:
            proc.kill()
            log.close()
            raise
        return cls(proc, f"http://127.0.0.1:{port}/v1/route", _lua(work / f"route-{label}.lua", "route", key, origins),
                   log, db, f"{policy['name']} ({policy['kind']})")

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def warm_up(self) -> None:
        run_wrk(self.url, self.script, 3)

    def measure(self, seconds: float) -> dict[str, Any]:
        return run_wrk(self.url, self.script, seconds, pid=self.proc.pid)

    def about(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        if self.db is not None:
            out["db_mib"] = round(self.db.stat().st_size / 2**20, 1)
        return out

    def soak(self, seconds: float, admin_key: str | None = None) -> dict[str, Any]:
        """``seconds`` of wrk with the server's and its writer's RSS before and after; with
        ``admin_key``, the server's metrics per ``SOAK_WINDOW_S`` window (:func:`_soak_window`)."""
        pid = self.proc.pid
        run_wrk(self.url, self.script, 10)
        rss0, child0 = _rss_kib(pid), _children_rss_kib(pid)
        windows: list[dict[str, Any]] = []
        stop = threading.Event()

        def watch() -> None:
            assert admin_key is not None
            base = self.url.rsplit("/v1/", 1)[0]
            prev, t_prev = _scrape(base, admin_key), time.monotonic()
            t0 = t_prev
            while not stop.wait(SOAK_WINDOW_S):
                cur, t = _scrape(base, admin_key), time.monotonic()
                windows.append(_soak_window(prev, cur, t - t_prev, t - t0, self.db))
                prev, t_prev = cur, t

        watcher = threading.Thread(target=watch, name="soak-metrics", daemon=True) if admin_key else None
        if watcher is not None:
            watcher.start()
        try:
            soak = run_wrk(self.url, self.script, seconds, pid=pid)
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(timeout=30)
        soak.update({"seconds": seconds, "rss_start_kib": rss0, "rss_end_kib": _rss_kib(pid),
                     "writer_rss_start_kib": child0, "writer_rss_end_kib": _children_rss_kib(pid),
                     "db_mib": round(self.db.stat().st_size / 2**20, 1) if self.db is not None else None,
                     "windows": windows})
        return soak

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            self.log = None


#: seconds per soak window (the soak's per-window metrics)
SOAK_WINDOW_S = 30.0


def _scrape(base: str, admin_key: str) -> dict[tuple[str, str], float]:
    """The router's ``/metrics`` as {(sample name, its ``le`` label or ""): value} (label-free
    families and histograms only: enough for the soak windows)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if set(sample.labels) <= {"le"}:
                out[(sample.name, sample.labels.get("le", ""))] = sample.value
    return out


def _soak_window(prev: dict[tuple[str, str], float], cur: dict[tuple[str, str], float], seconds: float,
                 end_s: float, db: Path | None) -> dict[str, Any]:
    """One soak window from two scrapes: decisions/s, the share of in-server route times over
    10 ms, the checkpoints run between commits (count, mean ms, share over 10 ms), log size."""

    def delta(name: str, le: str = "") -> float:
        return cur.get((name, le), 0.0) - prev.get((name, le), 0.0)

    def over_10ms(hist: str) -> float | None:
        n = delta(f"{hist}_count")
        return round(100.0 * (1.0 - delta(f"{hist}_bucket", "0.01") / n), 3) if n else None

    routes = delta("xroute_router_route_seconds_count")
    ckpt = delta("xroute_router_log_checkpoint_seconds_count")
    return {"end_s": round(end_s, 1), "decisions_per_s": round(routes / seconds, 1),
            "route_over_10ms_pct": over_10ms("xroute_router_route_seconds"),
            "checkpoints": int(ckpt),
            "checkpoint_mean_ms": round(1e3 * delta("xroute_router_log_checkpoint_seconds_sum") / ckpt, 2) if ckpt else None,
            "checkpoint_over_10ms_pct": over_10ms("xroute_router_log_checkpoint_seconds"),
            "db_mib": round(db.stat().st_size / 2**20, 1) if db is not None and db.exists() else None}


def _fsync_ms(work: Path) -> dict[str, float]:
    """fdatasync latency of the disk holding the decision log (the commit's floor under FULL)."""
    p = work / "fsync.bin"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    ts = []
    try:
        for _ in range(200):
            os.write(fd, b"x" * 8192)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            ts.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        p.unlink()
    return {"p50": round(float(np.percentile(ts, 50)) * 1e3, 3), "p99": round(float(np.percentile(ts, 99)) * 1e3, 3)}


# ---------------------------------------------------------------------------------------- main
def at_least(ap: argparse.ArgumentParser, *checks: tuple[str, float, float]) -> None:
    """``ap.error`` for the first ``(option, value, lowest)`` whose value is below its lowest."""
    for name, value, low in checks:
        if value < low:
            ap.error(f"{name} must be at least {low:g} (got {value:g})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of wrk per HTTP measurement")
    ap.add_argument("--soak-s", type=float, default=300.0, help="soak length in seconds (0 = no soak)")
    ap.add_argument("--rounds", type=int, default=3, help="paired runs of each headline row (route, learned)")
    ap.add_argument("--decisions", type=int, default=20000, help="in-process decisions per measurement (>= 100)")
    ap.add_argument("--model", default="", help="model URI/path for xroute serve ('' = the greedy fallback)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "router.json")
    ap.add_argument("--serve", choices=["trivial", "numpy", "bare", "route"], help=argparse.SUPPRESS)
    ap.add_argument("--stub", choices=["decision", "log"], help=argparse.SUPPRESS)
    ap.add_argument("--stack", choices=sorted(STACKS), default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ope-ab", action="store_true", help="only: the OPE logging's cost, on vs off (module docstring)")
    ap.add_argument("--against", type=Path, help="only: this checkout against the checkout DIR (module docstring)")
    a = ap.parse_args()
    at_least(ap, ("--decisions", a.decisions, 100), ("--rounds", a.rounds, 1), ("--duration", a.duration, 1))
    if a.serve:
        _serve_app(a.serve, a.port, a.stack, a.stub)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    if a.against is not None:
        if not (a.against / "router").is_dir():
            ap.error(f"--against: {a.against} is not a checkout of this repository")
        try:
            res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                   "load_average_at_start": os.getloadavg(),
                   "inprocess": bench_against_inprocess(work, a.against, a.decisions, a.rounds),
                   "http": bench_against_http(work, a.against, a.duration, a.rounds),
                   "load_average_at_end": os.getloadavg()}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out = a.out if a.out != ap.get_default("out") else a.out.with_name("router_against.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        print(against_table(res))
        print(f"\nwritten: {out}")
        return
    if a.ope_ab:
        try:
            model = learned_export(work / "learned")
            res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                   "load_average_at_start": os.getloadavg(),
                   "inprocess": bench_ope_inprocess(REPO / "data" / "bundles" / "default", model, a.decisions,
                                                    a.rounds),
                   "http": bench_ope_http(work, a.duration, a.rounds), "load_average_at_end": os.getloadavg()}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out = a.out if a.out != ap.get_default("out") else a.out.with_name("router_ope.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2))
        print(ope_table(res))
        print(f"\nwritten: {out}")
        return
    try:
        b100 = make_bundle(work / "bundle100")
        model = learned_export(work / "learned")
        res: dict[str, Any] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "inprocess_100_offerings": bench_inprocess(b100, model, a.decisions),
            "inprocess_shipped_bundle": bench_inprocess(REPO / "data" / "bundles" / "default", model, a.decisions),
            "fsync_ms": _fsync_ms(work),
            "server": {**server_stack(), "workers": 1, "access_log": "router: its own JSON access log on; "
                       "trivial apps: none (uvicorn's off for both)"},
            "load_average_at_start": os.getloadavg(),
            "http": bench_http(work, None, a.duration, a.soak_s, a.model, a.rounds),
            "load_average_at_end": os.getloadavg(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {a.out}")


def table(res: dict[str, Any]) -> str:
    """The results as markdown tables (the JSON file has everything)."""
    lines = [f"machine: {res['machine']}; fsync p50 {res['fsync_ms']['p50']} ms, p99 {res['fsync_ms']['p99']} ms", "",
             "| in-process decision | offerings | features->argmax p50 / p99 us | engine.decide p50 / p99 us |",
             "|---|---:|---:|---:|"]
    for where in ("inprocess_100_offerings", "inprocess_shipped_bundle"):
        for pol, v in res[where].items():
            f, e = v["features_to_argmax"], v["engine_decide"]
            lines.append(f"| {pol} ({where.removeprefix('inprocess_')}) | {v['offerings']} | {f['p50_us']} / "
                         f"{f['p99_us']} | {e['p50_us']} / {e['p99_us']} |")
    http = res["http"]
    if "skipped" in http:
        return "\n".join([*lines, "", f"HTTP: {http['skipped']}"])
    lines += ["", "| HTTP (wrk -c10, one worker) | req/s | vs trivial | server CPU us/req (writer) | p50 ms | p99 ms "
              "| policy | settings |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for k, v in http.items():
        if isinstance(v, dict) and "rps" in v:
            ratio = http.get(f"{k}_vs_trivial", 1.0 if k.startswith("trivial") else "")
            if "vs_trivial_range" in v:  # the median of the rounds [their range]
                ratio = f"{ratio} [{v['vs_trivial_range'][0]}-{v['vs_trivial_range'][1]}]"
            if k != "soak":  # and what a request costs the (saturated) event loop
                ratio = f"{ratio} ({1e6 / v['rps']:.0f} us/req)".lstrip()
            cpu = v.get("server_cpu_us_per_req", "")
            if v.get("children_cpu_us_per_req"):
                cpu = f"{cpu} ({v['children_cpu_us_per_req']})"
            p99 = f"{v['p99_ms']} (max {v['p99_ms_max']})" if len(v.get("runs", ())) > 1 else v["p99_ms"]
            lines.append(f"| {k} | {v['rps']} | {ratio} | {cpu} | {v['p50_ms']} | {p99} | "
                         f"{v.get('policy', '')} | {v.get('settings', '')} |")
    soak = http.get("soak")
    if soak:
        lines += ["", f"soak {soak['seconds']:g} s: {soak['rps']} req/s, p99 {soak['p99_ms']} ms, RSS "
                  f"{soak['rss_start_kib'] / 1024:.0f} -> {soak['rss_end_kib'] / 1024:.0f} MiB (writer process "
                  f"{soak['writer_rss_start_kib'] / 1024:.0f} -> {soak['writer_rss_end_kib'] / 1024:.0f} MiB), decision log "
                  f"{soak['db_mib']} MiB"]
        if soak.get("windows"):
            lines += ["", "| soak window ends at s | decisions/s | route > 10 ms % | checkpoints | checkpoint mean ms "
                      "| checkpoint > 10 ms % | log MiB |", "|---:|---:|---:|---:|---:|---:|---:|"]
            lines += [f"| {w['end_s']:g} | {w['decisions_per_s']} | {w['route_over_10ms_pct']} | {w['checkpoints']} | "
                      f"{w['checkpoint_mean_ms']} | {w['checkpoint_over_10ms_pct']} | {w['db_mib']} |"
                      for w in soak["windows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
