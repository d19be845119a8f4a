"""Tenant quotas (``docs/quotas.md``): what the check-and-reserve costs, and what quotas cost the route.

1. The state's operations with a quota charge, awaited one at a time on one event loop (what a
   request's task pays), p50/p99 per call: ``admit`` of a request counted in two buckets (its
   tenant's and its (tenant, model) one, every limit set, always admitted: the sliding window
   fills to the run's length) on a pool with room, ``settle`` (the pool released, the quotas
   reconciled), ``settle`` undoing an admission, ``view`` of the two buckets -- on the embedded
   state in this process and on a real ``redis-server`` over loopback (one Lua script per call,
   redis-py's asyncio client). Targets (issue 22): check-and-reserve p99 <= 0.5 ms embedded,
   <= 1 ms on Redis.
2. Redis: a request's state calls as the route and the feedback make them -- one ``admit`` (with
   the quota charge, quotas on), one ``settle`` (release, outcome, and the quotas) -- 32
   concurrent lifecycles, quotas on and off in interleaved rounds: this process's CPU per request
   (redis-py), the server's (the Lua scripts), and the rate. In process: the service's decision
   (``router.service.admission.decide``: rank, one admission of the pool and the quotas, the
   engine's admission) on the shipped bundle with the embedded state, the tenant with and without
   quotas, interleaved rounds.
3. HTTP (``--http``; needs wrk): ``POST /v1/route`` of ``xroute serve`` (one worker, greedy,
   shipped bundle) on the embedded state and on Redis, three ways each -- ``off`` (neither quotas
   nor prefix affinity), ``on`` (the tenant's quotas), ``both`` (the quotas, and every request
   carrying prefix block hashes and a session: the affinity's lookup and record) -- servers up
   throughout, ``--rounds`` rounds in rotated order, each run paired with the trivial endpoint of
   ``bench_router.py`` (so the machine's drift does not bias the ratios); reported: median req/s,
   p99, the server's CPU per request, and the ratios to ``off`` of each round's ``vs_trivial``
   (median and range). Targets (issue 35): ``on`` >= 0.9 of ``off``, ``both`` >= 0.85 of ``off``.
   ``--against DIR`` adds another checkout's servers (e.g. a ``git worktree`` of main) to the same
   rounds, so before and after face the same machine; ``--http-only`` runs this part alone.

Usage::

    .venv/bin/python benchmarks/bench_quotas.py                        # 1 and 2 (~1 min)
    .venv/bin/python benchmarks/bench_quotas.py --http --duration 10   # and 3 (~12 min)

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


async def bench_ops(state: Any, n: int) -> dict[str, dict[str, float]]:
    from router.state.base import QUOTA_UNDO, Admission, QuotaCharge, QuotaSettle, Settlement

    assert len(BUCKETS) == 2
    charge = QuotaCharge(BUCKETS, 2000, 1e-5)
    out = {"admit": await _time(n, lambda i: state.admit(Admission(f"r{i}", CANDIDATES, 300, charge)))}
    out["settle"] = await _time(n // 2, lambda i: state.settle(Settlement(f"r{i}", quota=QuotaSettle(1200, 8e-6))))
    out["undo"] = await _time(n // 2, lambda i: state.settle(Settlement(f"r{n // 2 + i}", quota=QUOTA_UNDO)))
    out["view"] = await _time(n // 2, lambda i: state.view([b.key for b in BUCKETS]))
    return out


CANDIDATES = [(f"pool-{i}", 1_000_000) for i in range(3)]


async def _lifecycles(state: Any, tag: str, quotas: bool, tasks: int, per_task: int) -> int:
    """``tasks`` concurrent request lifecycles on ``state``, as the route and the feedback make
    them: one admission (the pool, and the quotas), then one settlement (the pool released, the
    outcome folded into its statistics, and the quotas reconciled)."""
    from router.state.base import Admission, PoolOutcome, QuotaCharge, QuotaSettle, Settlement

    charge = QuotaCharge(BUCKETS, 2000, 1e-5) if quotas else None
    settle = QuotaSettle(1200, 8e-6) if quotas else None
    outcome = PoolOutcome("pool-0", 100.0, 900.0)

    async def one(t: int) -> None:
        for i in range(per_task):
            rid = f"{tag}-{t}-{i}"
            await state.admit(Admission(rid, CANDIDATES, 300, charge))
            await state.settle(Settlement(rid, outcome=outcome, quota=settle))

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
    """The service's decision with an embedded state, the tenant's quotas on and off."""
    import tempfile

    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine
    from router.state.base import Settlement
    from router.state.embedded import EmbeddedState
    from tests.state_support import decide
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
        engines[v].quota_usage = states[v].quota_reader
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
                decide(eng, req, who, did, wall0 + i * 1e-3, state=st)
                ts[i] = time.perf_counter() - t0
                st.core.settle(Settlement(did))  # (the pools would fill: this measures the decision, not admission)
            runs[v].append(ts[200:] * 1e6)
    shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {}
    for v, xs in runs.items():
        out[v] = {"p50_us": round(float(np.median([np.percentile(x, 50) for x in xs])), 1),
                  "p99_us": round(float(np.median([np.percentile(x, 99) for x in xs])), 1)}
    out["p50_on_minus_off_us"] = round(out["on"]["p50_us"] - out["off"]["p50_us"], 1)
    return out


#: the ``both`` variant's requests: a conversation's prompt is its blocks' ids chained from the session's
#: number (``prefix_hashes``: as many as the prompt has blocks of 512 tokens), so each session's turns
#: share their leading blocks and the affinity index matches them
_PREFIX_LUA = """local origins = {%(origins)s}
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(key)s"
request = function()
  i = i + 1
  local o = origins[(i %% #origins) + 1]
  local input = 200 + (i * 37) %% 1800
  local s = i %% 64
  local hashes = {}
  for b = 1, math.ceil(input / 512) do hashes[b] = tostring(s * 1000 + b) end
  local body = string.format('{"origin":"%%s","input_tokens":%%d,"max_output_tokens":%%d,"ttft_ms":2000,"tpot_ms":100,'
    .. '"session_id":"c%%d","prefix_hashes":[%%s]}', o, input, 10 + (i * 13) %% 40, s, table.concat(hashes, ","))
  return wrk.format(nil, nil, nil, body)
end
"""


def _variants(work: Path, redis_url: str | None) -> dict[str, tuple[dict[str, str], bool]]:
    """Each HTTP variant: its settings, and whether its requests carry prefix hashes and a session."""
    cfg = work / "quotas.yaml"
    cfg.write_text(json.dumps({"tenants": {"bench": {"quotas": QUOTAS}}}))
    (work / "none.yaml").write_text("{}\n")
    off, on = {"XROUTE_ROUTER_CONFIG": str(work / "none.yaml")}, {"XROUTE_ROUTER_CONFIG": str(cfg)}
    backends: dict[str, dict[str, str]] = {"embedded": {}}
    if redis_url is not None:
        backends["redis"] = {"XROUTE_ROUTER_STATE_BACKEND": "redis", "XROUTE_ROUTER_STATE_URL": redis_url}
    out: dict[str, tuple[dict[str, str], bool]] = {}
    for backend, shared in backends.items():
        for v, (quota, prefix) in {"off": (off, False), "on": (on, False), "both": (on, True)}.items():
            prefixed = {"XROUTE_ROUTER_STATE_PREFIX": v} if backend == "redis" else {}
            out[f"{backend}_{v}"] = ({**shared, **prefixed, **quota}, prefix)
    return out


def _route_server(br: Any, work: Path, key: str, env: dict[str, str], label: str, prefix: bool,
                  checkout: Path) -> Any:
    """``xroute serve`` of ``checkout`` (its code: ``PYTHONPATH`` and working directory), with its
    wrk script (the ``both`` variant's: :data:`_PREFIX_LUA`)."""
    import httpx

    saved = br.REPO
    br.REPO = checkout  # (the server's working directory: python -m imports from there first)
    try:
        srv = br._Server.route(work, None, "", key, {**env, "PYTHONPATH": str(checkout)}, label)
    finally:
        br.REPO = saved
    if prefix:
        origins = httpx.get(srv.url.replace("/v1/route", "/v1/offerings"),
                            headers={"Authorization": f"Bearer {key}"}).json()["origins"]
        srv.script = work / f"route-{label}.lua"
        srv.script.write_text(_PREFIX_LUA % {"origins": ", ".join(f'"{o}"' for o in origins), "key": key})
    return srv


def _ratios(runs: dict[str, list[dict[str, Any]]], tag: str = "") -> dict[str, Any]:
    """Each round's ``vs_trivial`` of ``on`` and ``both`` over ``off``'s (the same backend and
    checkout): median and range, and the server CPU a request they add."""
    out: dict[str, Any] = {}
    for pair in ("on_vs_off", "both_vs_off"):
        for backend in ("embedded", "redis"):
            a, b = f"{tag}{backend}_{pair.split('_vs_')[0]}", f"{tag}{backend}_off"
            if a in runs and b in runs:
                ratios = [x["vs_trivial"] / y["vs_trivial"] for x, y in zip(runs[a], runs[b])]
                cpu = [x.get("server_cpu_us_per_req", np.nan) - y.get("server_cpu_us_per_req", np.nan)
                       for x, y in zip(runs[a], runs[b])]
                out[f"{tag}{backend}_{pair}"] = {"median": round(float(np.median(ratios)), 3),
                                                 "min": round(min(ratios), 3), "max": round(max(ratios), 3),
                                                 "server_cpu_us_per_req_added": round(float(np.nanmedian(cpu)), 1)}
    return out


def bench_http(work: Path, redis_url: str | None, seconds: float, rounds: int,
               against: Path | None = None) -> dict[str, Any]:
    """``POST /v1/route`` with quotas off, on, and with prefix affinity too (module docstring, 3);
    with ``against`` (another checkout), its servers too -- labelled ``against:`` -- in the same
    rounds, so both face the same machine."""
    import bench_router as br

    from router.control.keys import add_key

    env = dict(os.environ)
    key = add_key(work / "keys.json", "bench")
    variants = {v: (o, pf, REPO) for v, (o, pf) in _variants(work, redis_url).items()}
    if against is not None:
        variants.update({f"against:{v}": ({**o, **({"XROUTE_ROUTER_STATE_PREFIX": f"against-{o['XROUTE_ROUTER_STATE_PREFIX']}"}
                                                   if "XROUTE_ROUTER_STATE_PREFIX" in o else {})}, pf, against)
                         for v, (o, pf) in _variants(work, redis_url).items()})
    ref = br._Server.simple(work, "trivial", "auto", {**env, "PYTHONPATH": str(REPO)})
    servers: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        ref.warm_up()
        for v, (overrides, prefix, checkout) in variants.items():
            servers[v] = _route_server(br, work, key, {**env, **overrides}, v.replace(":", "-"), prefix, checkout)
            servers[v].warm_up()
        order = list(variants)
        for r in range(rounds):
            for v in order[r % len(order):] + order[: r % len(order)]:
                runs[v].append(br.paired_run(ref, servers[v], seconds, f"round {r + 1}/{rounds} {v}"))
    finally:
        ref.stop()
        for srv in servers.values():
            srv.stop()
    out: dict[str, Any] = {v: br._median_of(runs[v]) for v in variants}
    out.update(_ratios(runs))
    if against is not None:
        out.update(_ratios(runs, "against:"))
        out["against"] = str(against)
    return out


def _http_part(res: dict[str, Any], redis_url: str | None, seconds: float, rounds: int,
               against: Path | None = None) -> None:
    if shutil.which("wrk") is None:
        res["http"] = {"skipped": "wrk not found: sudo apt-get install wrk"}
        return
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="xroute-bench-quotas-http-"))
    try:
        res["http"] = bench_http(work, redis_url, seconds, rounds, against)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _state_parts(res: dict[str, Any], server: Any, a: argparse.Namespace) -> None:
    """Parts 1 and 2 (module docstring)."""
    from router.state.embedded import EmbeddedState
    from router.state.redis import RedisState

    res["embedded"] = asyncio.run(bench_ops(EmbeddedState(), a.n))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per operation, embedded (>= 1000)")
    ap.add_argument("--redis-n", type=int, default=5000, help="calls per operation, Redis (>= 1000)")
    ap.add_argument("--decide-n", type=int, default=4000, help="decisions per in-process round (>= 1000)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (in process and HTTP)")
    ap.add_argument("--http", action="store_true", help="also POST /v1/route with quotas off, on, and with prefix "
                                                        "affinity (wrk)")
    ap.add_argument("--http-only", action="store_true", help="only the HTTP part (any checkout's xroute serve)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per HTTP run")
    ap.add_argument("--against", type=Path, default=None, help="another checkout (e.g. a git worktree of main) whose "
                                                               "servers run in the same HTTP rounds")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quotas.json")
    a = ap.parse_args()
    for name, v in (("--n", a.n), ("--redis-n", a.redis_n), ("--decide-n", a.decide_n)):
        if v < 1000:
            ap.error(f"{name} must be at least 1000 (got {v})")
    from tests.servers import RedisServer, ServerError

    res: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (nproc), Python "
                                      f"{platform.python_version()}; shared with other work",
                           "checkout": str(REPO), "load_average_at_start": os.getloadavg()}
    try:
        server = RedisServer().start()
    except ServerError as e:
        sys.exit(f"bench_quotas: error: {e}")
    try:
        if not a.http_only:
            _state_parts(res, server, a)
        if a.http or a.http_only:
            _http_part(res, server.url, a.duration, a.rounds, a.against)
    finally:
        server.close()
    res["load_average_at_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {a.out}")


def table(res: dict[str, Any]) -> str:
    lines = [f"machine: {res['machine']}; load average {res['load_average_at_start'][0]:.2f} at start"]
    if "embedded" in res:
        lines += ["", "| operation (quota charged) | embedded p50 / p99 us | Redis (loopback) p50 / p99 us |",
                  "|---|---:|---:|"]
        for op in res["embedded"]:
            e, r = res["embedded"][op], res["redis"][op]
            lines.append(f"| {op} | {e['p50_us']} / {e['p99_us']} | {r['p50_us']} / {r['p99_us']} |")
        lc = res["lifecycles"]
        lines += ["", f"| Redis: {lc['tasks']} concurrent lifecycles (admit, settle) | client CPU us/req | "
                      "server CPU us/req | req/s |", "|---|---:|---:|---:|"]
        for v in ("off", "on"):
            x = lc[v]
            lines.append(f"| quotas {v} | {x['client_cpu_us_per_req']} | {x['server_cpu_us_per_req']} | "
                         f"{x['req_per_s']} |")
        d = res["decide"]
        lines += ["", "| the service's decision (embedded state) | p50 us | p99 us |", "|---|---:|---:|",
                  f"| quotas off | {d['off']['p50_us']} | {d['off']['p99_us']} |",
                  f"| quotas on | {d['on']['p50_us']} | {d['on']['p99_us']} |"]
    http = res.get("http")
    if http and "skipped" not in http:
        lines += ["", "| POST /v1/route | req/s | p99 ms | server CPU us/req | vs trivial |", "|---|---:|---:|---:|---:|"]
        for v, m in http.items():
            if "_vs_" not in v and isinstance(m, dict):
                lines.append(f"| {v} | {m['rps']} | {m['p99_ms']} | {m.get('server_cpu_us_per_req')} | "
                             f"{m['vs_trivial']} |")
        for k, x in http.items():
            if "_vs_" in k:
                lines.append(f"\n{k}: {x['median']} (rounds {x['min']}-{x['max']}), "
                             f"+{x['server_cpu_us_per_req_added']} us server CPU per request")
    elif http:
        lines.append(f"\nHTTP: {http['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
