"""Tenant quotas (``docs/quotas.md``): what the check-and-reserve costs, and what quotas cost the route.

1. The state's quota operations, awaited one at a time on one event loop (what a request's task
   pays), p50/p99 per call: ``quota_reserve`` of a request counted in two buckets (its tenant's
   and its (tenant, model) one, every limit set, always admitted: the sliding window fills to the
   run's length), ``quota_settle``, ``quota_release``, ``quota_usage`` -- on the embedded state in
   this process and on a real ``redis-server`` over loopback (one Lua script per call, redis-py's
   asyncio client). Targets (issue 22): check-and-reserve p99 <= 0.5 ms embedded, <= 1 ms on Redis.
2. Redis: a request's state calls as the route and the feedback make them -- reserve a pool and
   (quotas on) the quotas in one event-loop iteration, then release (and settle) -- 32 concurrent
   lifecycles, quotas on and off in interleaved rounds: this process's CPU per request (redis-py),
   the server's (the Lua scripts), and the rate. In process: ``RoutingEngine.decide`` (rank, pool reservation, quota reservation, admit) on the
   shipped bundle with the embedded state, the tenant with and without quotas, interleaved rounds.
3. HTTP (``--http``; needs wrk): ``POST /v1/route`` of ``xroute serve`` (one worker, greedy,
   shipped bundle) with the tenant's quotas on and off -- on the embedded state and on Redis --
   servers up throughout, ``--rounds`` rounds in rotated order, each run paired with the trivial
   endpoint of ``bench_router.py`` (so the machine's drift does not bias the ratios); reported:
   median req/s, p99, the server's CPU per request, and the on/off ratio of each round's
   ``vs_trivial`` (median and range).

Usage::

    .venv/bin/python benchmarks/bench_quotas.py                        # 1 and 2 (~1 min)
    .venv/bin/python benchmarks/bench_quotas.py --http --duration 10   # and 3 (~8 min)

Prints a markdown table and writes ``benchmarks/results/quotas.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from router.state.base import RouterState  # noqa: E402
from router.state.embedded import EmbeddedState  # noqa: E402
from xroute.schema.quota import TenantQuotas, buckets_for  # noqa: E402

#: every limit set, none ever reached in a run
QUOTAS = {"max_concurrent": 1_000_000, "tokens_per_minute": 10**12, "requests_per_day": 10**9, "usd_per_day": 1e9,
          "models": {"llama-2-7b": {"max_concurrent": 1_000_000, "tokens_per_minute": 10**12, "usd_per_day": 1e9}}}
BUCKETS = buckets_for(TenantQuotas.model_validate(QUOTAS), "bench", "llama-2-7b")


async def _time(n: int, op: Callable[[int], Awaitable[Any]]) -> dict[str, float]:
    ts = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        await op(i)
        ts[i] = time.perf_counter() - t0
    ts = ts[min(200, n // 10):] * 1e6  # the first calls warm caches and connections
    return {"p50_us": round(float(np.percentile(ts, 50)), 1), "p99_us": round(float(np.percentile(ts, 99)), 1),
            "mean_us": round(float(ts.mean()), 1), "calls": int(ts.size)}


async def bench_ops(state: RouterState, n: int) -> dict[str, dict[str, float]]:
    assert len(BUCKETS) == 2
    out = {"quota_reserve": await _time(n, lambda i: state.quota_reserve(f"r{i}", BUCKETS, 2000, 1e-5, 300))}
    out["quota_settle"] = await _time(n // 2, lambda i: state.quota_settle(f"r{i}", 1200, 8e-6))
    out["quota_release"] = await _time(n // 2, lambda i: state.quota_release(f"r{n // 2 + i}"))
    out["quota_usage"] = await _time(n // 2, lambda i: state.quota_usage([b.key for b in BUCKETS]))
    return out


CANDIDATES = [(f"pool-{i}", 1_000_000) for i in range(3)]


async def _lifecycles(state: RouterState, tag: str, quotas: bool, tasks: int, per_task: int) -> int:
    """``tasks`` concurrent request lifecycles on ``state``, as the route and the feedback make
    them: reserve a pool (and the quotas, in the same round trip: ``reserve_with_quota``), then
    release it, and fold the outcome into the pool's statistics (and settle the quotas, in the same
    round trip)."""
    async def one(t: int) -> None:
        for i in range(per_task):
            rid = f"{tag}-{t}-{i}"
            if quotas:  # what the route and the feedback do
                await state.reserve_with_quota(CANDIDATES, rid, 300, BUCKETS, 2000, 1e-5)
                await state.release(rid)
                await asyncio.gather(state.observe("pool-0", 100.0, 900.0), state.quota_settle(rid, 1200, 8e-6))
            else:
                await state.reserve(CANDIDATES, rid, 300)
                await state.release(rid)
                await state.observe("pool-0", 100.0, 900.0)

    await asyncio.gather(*(one(t) for t in range(tasks)))
    return tasks * per_task


def bench_lifecycles(url: str, server_pid: int, rounds: int, tasks: int = 32, per_task: int = 300) -> dict[str, Any]:
    """Redis: the CPU a request's state calls cost with quotas on and off -- this process's (the
    router's side: redis-py) and the server's (the scripts) per request, and the wall-clock rate --
    ``tasks`` concurrent lifecycles (:func:`_lifecycles`), ``rounds`` interleaved rounds, medians.
    CPU time, unlike a rate, hardly moves with what else the shared cores run."""
    from bench_router import proc_stat

    from router.state.redis import RedisState

    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}

    async def go(v: str, r: int) -> dict[str, float]:
        state = RedisState(url, prefix=f"life-{v}")
        try:
            await _lifecycles(state, f"w{r}", v == "on", tasks, 20)  # warm the connections and scripts
            c0, s0, w0 = time.process_time(), proc_stat(server_pid)[1], time.perf_counter()
            n = await _lifecycles(state, f"r{r}", v == "on", tasks, per_task)
            c1, s1, w1 = time.process_time(), proc_stat(server_pid)[1], time.perf_counter()
        finally:
            await state.close()
        return {"client_cpu_us_per_req": (c1 - c0) / n * 1e6, "server_cpu_us_per_req": (s1 - s0) / n * 1e6,
                "req_per_s": n / (w1 - w0)}

    for r in range(rounds):
        for v in (("off", "on") if r % 2 == 0 else ("on", "off")):
            runs[v].append(asyncio.run(go(v, r)))
    out: dict[str, Any] = {v: {k: round(float(np.median([x[k] for x in xs])), 1) for k in xs[0]} for v, xs in runs.items()}
    out["tasks"], out["per_task"] = tasks, per_task
    return out


def bench_decide(n: int, rounds: int) -> dict[str, Any]:
    """``RoutingEngine.decide`` with an embedded state, the tenant's quotas on and off."""
    import tempfile

    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    work = Path(tempfile.mkdtemp(prefix="xroute-bench-quotas-"))
    (work / "router.yaml").write_text("{}\n")
    engines, states = {}, {}
    for v in ("off", "on"):
        tenants = {"bench": {"quotas": QUOTAS} if v == "on" else {}}  # declared either way: unknown tenants fail closed
        engines[v] = RoutingEngine(load_settings(work / "router.yaml", model_uri="", db_path=work / "d.db",
                                                 tenants=tenants, replay_speed=1e-6))
        states[v] = EmbeddedState()
        engines[v].quota_usage = states[v].quota_usage_now
    who = Principal("bench", "tenant", "k")
    origins = engines["off"].origins
    reqs = [RouteRequest.model_validate({"origin": origins[i % len(origins)], "input_tokens": 200 + (i * 37) % 1800,
                                         "max_output_tokens": 10 + (i * 13) % 40, "ttft_ms": 2000, "tpot_ms": 100})
            for i in range(n)]
    wall0 = engines["off"].source.start_wall
    runs: dict[str, list[np.ndarray]] = {"off": [], "on": []}
    for r in range(rounds):
        for v in (("off", "on") if r % 2 == 0 else ("on", "off")):
            eng, st = engines[v], states[v]
            ts = np.empty(n)
            for i, req in enumerate(reqs):
                did = f"d_{r}_{i}"
                t0 = time.perf_counter()
                eng.decide(req, who, did, wall0 + i * 1e-3, state=st)
                ts[i] = time.perf_counter() - t0
                st.release_now(did)  # (the pools would fill: this measures the decision, not admission)
            runs[v].append(ts[200:] * 1e6)
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {}
    for v, xs in runs.items():
        out[v] = {"p50_us": round(float(np.median([np.percentile(x, 50) for x in xs])), 1),
                  "p99_us": round(float(np.median([np.percentile(x, 99) for x in xs])), 1)}
    out["p50_on_minus_off_us"] = round(out["on"]["p50_us"] - out["off"]["p50_us"], 1)
    return out


def bench_http(work: Path, redis_url: str | None, seconds: float, rounds: int) -> dict[str, Any]:
    """``POST /v1/route`` with quotas on and off (module docstring, 3)."""
    import bench_router as br

    from router.control.keys import add_key

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    key = add_key(work / "keys.json", "bench")
    cfg = work / "quotas.yaml"
    cfg.write_text(json.dumps({"tenants": {"bench": {"quotas": QUOTAS}}}))
    (work / "none.yaml").write_text("{}\n")
    variants: dict[str, dict[str, str]] = {"embedded_off": {"XROUTE_ROUTER_CONFIG": str(work / "none.yaml")},
                                           "embedded_on": {"XROUTE_ROUTER_CONFIG": str(cfg)}}
    if redis_url is not None:
        shared = {"XROUTE_ROUTER_STATE_BACKEND": "redis", "XROUTE_ROUTER_STATE_URL": redis_url}
        variants["redis_off"] = {**shared, "XROUTE_ROUTER_CONFIG": str(work / "none.yaml"),
                                 "XROUTE_ROUTER_STATE_PREFIX": "off"}
        variants["redis_on"] = {**shared, "XROUTE_ROUTER_CONFIG": str(cfg), "XROUTE_ROUTER_STATE_PREFIX": "on"}
    ref = br._Server.simple(work, "trivial", "auto", env)
    servers: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        ref.warm_up()
        for v, overrides in variants.items():
            servers[v] = br._Server.route(work, None, "", key, {**env, **overrides}, f"quotas-{v}")
            servers[v].warm_up()
        order = list(variants)
        for r in range(rounds):
            for v in order[r % len(order):] + order[: r % len(order)]:
                base = ref.measure(seconds)
                got = servers[v].measure(seconds)
                got["paired_trivial_rps"] = base["rps"]
                got["vs_trivial"] = round(got["rps"] / base["rps"], 3)
                runs[v].append(got)
                print(f"  round {r + 1}/{rounds} {v}: {got['rps']} req/s ({got['non_2xx']} non-2xx), "
                      f"{got['vs_trivial']} of trivial, {got.get('server_cpu_us_per_req')} us CPU/req",
                      file=sys.stderr, flush=True)
    finally:
        ref.stop()
        for srv in servers.values():
            srv.stop()
    out: dict[str, Any] = {v: br._median_of(runs[v]) for v in variants}
    for backend in ("embedded", "redis"):
        if f"{backend}_on" in runs:
            ratios = [a["vs_trivial"] / b["vs_trivial"] for a, b in zip(runs[f"{backend}_on"], runs[f"{backend}_off"])]
            cpu = [a.get("server_cpu_us_per_req", np.nan) - b.get("server_cpu_us_per_req", np.nan)
                   for a, b in zip(runs[f"{backend}_on"], runs[f"{backend}_off"])]
            out[f"{backend}_on_vs_off"] = {"median": round(float(np.median(ratios)), 3),
                                           "min": round(min(ratios), 3), "max": round(max(ratios), 3),
                                           "server_cpu_us_per_req_added": round(float(np.nanmedian(cpu)), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per operation, embedded (>= 1000)")
    ap.add_argument("--redis-n", type=int, default=5000, help="calls per operation, Redis (>= 1000)")
    ap.add_argument("--decide-n", type=int, default=4000, help="decisions per in-process round (>= 1000)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (in process and HTTP)")
    ap.add_argument("--http", action="store_true", help="also POST /v1/route with quotas on and off (wrk)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per HTTP run")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quotas.json")
    a = ap.parse_args()
    for name, v in (("--n", a.n), ("--redis-n", a.redis_n), ("--decide-n", a.decide_n)):
        if v < 1000:
            ap.error(f"{name} must be at least 1000 (got {v})")
    from router.state.redis import RedisState
    from tests.servers import RedisServer, ServerError

    res: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (nproc), Python "
                                      f"{platform.python_version()}; shared with other work",
                           "load_average_at_start": os.getloadavg()}
    res["embedded"] = asyncio.run(bench_ops(EmbeddedState(), a.n))
    try:
        server = RedisServer().start()
    except ServerError as e:
        sys.exit(f"bench_quotas: error: {e}")
    try:
        async def run_redis() -> dict[str, dict[str, float]]:
            state = RedisState(server.url, prefix="bench")
            try:
                return await bench_ops(state, a.redis_n)
            finally:
                await state.close()

        res["redis"] = asyncio.run(run_redis())
        res["redis_server"] = "redis-server on 127.0.0.1 (loopback), no persistence"
        assert server.proc is not None
        res["lifecycles"] = bench_lifecycles(server.url, server.proc.pid, a.rounds)
        res["decide"] = bench_decide(a.decide_n, a.rounds)
        if a.http:
            if shutil.which("wrk") is None:
                res["http"] = {"skipped": "wrk not found: sudo apt-get install wrk"}
            else:
                import tempfile

                work = Path(tempfile.mkdtemp(prefix="xroute-bench-quotas-http-"))
                try:
                    res["http"] = bench_http(work, server.url, a.duration, a.rounds)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        server.close()
    res["load_average_at_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {a.out}")


def table(res: dict[str, Any]) -> str:
    lines = [f"machine: {res['machine']}; load average {res['load_average_at_start'][0]:.2f} at start", "",
             "| operation | embedded p50 / p99 us | Redis (loopback) p50 / p99 us |", "|---|---:|---:|"]
    for op in res["embedded"]:
        e, r = res["embedded"][op], res["redis"][op]
        lines.append(f"| {op} | {e['p50_us']} / {e['p99_us']} | {r['p50_us']} / {r['p99_us']} |")
    lc = res["lifecycles"]
    lines += ["", f"| Redis: {lc['tasks']} concurrent lifecycles (reserve, release, observe) | client CPU us/req | "
                  "server CPU us/req | req/s |", "|---|---:|---:|---:|"]
    for v in ("off", "on"):
        x = lc[v]
        lines.append(f"| quotas {v} | {x['client_cpu_us_per_req']} | {x['server_cpu_us_per_req']} | {x['req_per_s']} |")
    d = res["decide"]
    lines += ["", "| RoutingEngine.decide (embedded state) | p50 us | p99 us |", "|---|---:|---:|",
              f"| quotas off | {d['off']['p50_us']} | {d['off']['p99_us']} |",
              f"| quotas on | {d['on']['p50_us']} | {d['on']['p99_us']} |"]
    http = res.get("http")
    if http and "skipped" not in http:
        lines += ["", "| POST /v1/route | req/s | p99 ms | server CPU us/req | vs trivial |", "|---|---:|---:|---:|---:|"]
        for v, m in http.items():
            if v.endswith("_vs_off"):
                continue
            lines.append(f"| {v} | {m['rps']} | {m['p99_ms']} | {m.get('server_cpu_us_per_req')} | {m['vs_trivial']} |")
        for backend in ("embedded", "redis"):
            k = f"{backend}_on_vs_off"
            if k in http:
                x = http[k]
                lines.append(f"\n{backend}: quotas on / off = {x['median']} (rounds {x['min']}-{x['max']}), "
                             f"+{x['server_cpu_us_per_req_added']} us server CPU per request")
    elif http:
        lines.append(f"\nHTTP: {http['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
