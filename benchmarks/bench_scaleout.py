"""The router on its shared state, side by side (results: ``docs/results.md``, "Router").

``POST /v1/route`` of ``xroute serve`` under ``wrk`` (loopback, ``-t1``, ``--connections``
connections, the shipped bundle, no feedback) for: the embedded state with one worker; the Redis
state (a real ``redis-server`` on loopback, no persistence) with one and with two workers
(``--workers 2``); each with the greedy fallback and with a learned scorer of the DQN's default
shape. Every row is measured right after a run of a trivial FastAPI POST endpoint on the same
stack (its pair) and reported against it, the rows' order rotated each round; figures are medians
over ``--rounds``. The server's CPU time a request is the whole process tree's (the workers and
their decision-log writers). Then the state operations' own latency, both backends
(``benchmarks/bench_state.py``'s measurement).

Targets (issue 17): with Redis state, per worker >= 3,000 decisions/s at p99 <= 10 ms; the state
operations' p99 embedded <= 20 us, Redis over loopback <= 1 ms.

``--pin`` (Linux, 2+ cores): what one worker does with a core of its own -- the router's event-loop
process (every thread of it) on core 0, everything else (its decision-log writer, redis-server,
wrk, the trivial endpoint's pair, this script) on core 1; the one-worker rows only.

Usage::

    .venv/bin/python benchmarks/bench_scaleout.py [--duration 8 --rounds 3 --connections 10] [--pin]
        [--shared-with "another engineer's test runs"]

Prints a markdown table and writes ``benchmarks/results/scaleout.json`` (``scaleout_pinned.json``
with ``--pin``).
"""

from __future__ import annotations

import argparse
import asyncio
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
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench_router as br  # noqa: E402
import bench_state  # noqa: E402

#: (label, state backend, workers, policy)
ROWS = [("embedded_1w_greedy", "embedded", 1, "greedy"), ("embedded_1w_learned", "embedded", 1, "learned"),
        ("redis_1w_greedy", "redis", 1, "greedy"), ("redis_1w_learned", "redis", 1, "learned"),
        ("redis_2w_greedy", "redis", 2, "greedy"), ("redis_2w_learned", "redis", 2, "learned")]


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant process."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += br.child_pids(p)
        except OSError:
            pass
    return out


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every descendant (workers, log writers)."""
    total = 0.0
    for p in _tree(pid):
        try:
            total += br.proc_stat(p)[1]
        except OSError:
            continue
    return total


def _measure(server: br._Server, seconds: float, connections: int, redis_pid: int | None = None) -> dict[str, Any]:
    """wrk against ``server``; the CPU its process tree used a request, and the Redis server's."""
    cpu0 = _tree_cpu_s(server.proc.pid)
    r0 = _tree_cpu_s(redis_pid) if redis_pid is not None else 0.0
    out = br.run_wrk(server.url, server.script, seconds, connections=connections)
    cpu = _tree_cpu_s(server.proc.pid) - cpu0
    if out["requests"]:
        out["server_cpu_us_per_req"] = round(cpu / out["requests"] * 1e6, 1)
        if redis_pid is not None:
            out["redis_cpu_us_per_req"] = round((_tree_cpu_s(redis_pid) - r0) / out["requests"] * 1e6, 1)
    return out


def _others_cpu(seconds: float = 2.0) -> list[dict[str, Any]]:
    """What else used the CPUs over ``seconds`` (the top processes not under this one)."""
    mine = set(_tree(os.getpid()))

    def snap() -> dict[int, tuple[str, float]]:
        out = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) not in mine:
                try:
                    out[int(d.name)] = br.proc_stat(int(d.name))
                except (OSError, ValueError):
                    pass
        return out

    a = snap()
    time.sleep(seconds)
    b = snap()
    used = [(b[p][0], (b[p][1] - a[p][1]) / seconds) for p in b if p in a and b[p][1] > a[p][1]]
    return [{"process": n, "cores": round(c, 2)} for n, c in sorted(used, key=lambda x: -x[1])[:6]]


#: ``--pin``: the router's event loop on this core, everything else on the other
ROUTER_CORE, OTHERS_CORE = 0, 1


def _pin_process(pid: int, core: int) -> None:
    """Every thread of ``pid`` (not its child processes) onto ``core``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def bench_http(work: Path, redis_url: str, seconds: float, rounds: int, connections: int,
               redis_pid: int | None = None, pin: bool = False) -> dict[str, Any]:
    from router.control.keys import add_key

    keys = work / "keys.json"
    key = add_key(keys, "bench")
    learned = str(br.learned_export(work / "learned-http") or "")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rows = [r for r in ROWS if r[2] == 1] if pin else ROWS
    ref = br._Server.simple(work, "trivial", "auto", env)
    servers: dict[str, br._Server] = {}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in rows}
    try:
        ref.warm_up()
        if pin:
            _pin_process(ref.proc.pid, ROUTER_CORE)
        for label, backend, workers, policy in rows:
            row_env = dict(env)
            if backend == "redis":
                row_env.update(XROUTE_ROUTER_STATE_BACKEND="redis", XROUTE_ROUTER_STATE_URL=redis_url,
                               XROUTE_ROUTER_STATE_PREFIX=label)
            model = learned if policy == "learned" else ""
            servers[label] = br._Server.route(work, None, model, key, row_env, label,
                                              ["--workers", str(workers)] if workers > 1 else None)
            servers[label].warm_up()
            if pin:  # (its log writer, started with it, stays on the other core)
                _pin_process(servers[label].proc.pid, ROUTER_CORE)
        for r in range(rounds):
            order = rows[r % len(rows):] + rows[: r % len(rows)]
            for label, *_ in order:
                trivial = _measure(ref, seconds, connections)
                out = _measure(servers[label], seconds, connections,
                               redis_pid if label.startswith("redis") else None)
                out["paired_trivial_rps"] = trivial["rps"]
                out["vs_trivial"] = round(out["rps"] / trivial["rps"], 3)
                runs[label].append(out)
                print(f"  round {r + 1}/{rounds} {label}: {out['rps']} req/s, p99 {out['p99_ms']} ms, "
                      f"{out['non_2xx']} non-2xx", file=sys.stderr, flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
        ref.stop()
    results: dict[str, Any] = {}
    for label, backend, workers, _policy in rows:
        row = br._median_of(runs[label])
        row.update(state=backend, workers=workers, policy=servers[label].policy,
                   per_worker_rps=round(row["rps"] / workers, 1))
        results[label] = row
    for label, backend, _workers, policy in rows:
        base = results[f"embedded_1w_{policy}"]["rps"]
        results[label]["vs_embedded_1w"] = round(results[label]["rps"] / base, 3)
        if backend == "redis":
            results[label]["target_met"] = results[label]["per_worker_rps"] >= 3000 and results[label]["p99_ms"] <= 10
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of wrk per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="paired runs of each row")
    ap.add_argument("--connections", type=int, default=10, help="wrk connections")
    ap.add_argument("--state-n", type=int, default=20000, help="calls per state operation, embedded (>= 1000)")
    ap.add_argument("--redis-n", type=int, default=5000, help="calls per state operation, Redis (>= 1000)")
    ap.add_argument("--shared-with", default="", help="what else ran on the machine (for the record)")
    ap.add_argument("--pin", action="store_true", help="one worker with a core of its own (module docstring)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/scaleout.json "
                                                              "(scaleout_pinned.json with --pin)")
    a = ap.parse_args()
    if a.out is None:
        a.out = REPO / "benchmarks" / "results" / ("scaleout_pinned.json" if a.pin else "scaleout.json")
    if a.pin:
        if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
            sys.exit("bench_scaleout: error: --pin needs Linux and at least 2 usable cores")
        os.sched_setaffinity(0, {OTHERS_CORE})  # inherited by redis-server, wrk and the servers until re-pinned
    br.at_least(ap, ("--duration", a.duration, 1), ("--rounds", a.rounds, 1), ("--connections", a.connections, 1),
                ("--state-n", a.state_n, 1000), ("--redis-n", a.redis_n, 1000))
    if shutil.which("wrk") is None:
        sys.exit("bench_scaleout: error: wrk not found (sudo apt-get install wrk)")
    from router.state.embedded import EmbeddedState
    from router.state.redis import RedisState
    from tests.servers import RedisServer, ServerError

    try:
        redis_server = RedisServer().start()
    except ServerError as e:
        sys.exit(f"bench_scaleout: error: {e}")
    work = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    res: dict[str, Any] = {
        "machine": f"{platform.machine()}, nproc {os.cpu_count()}, Python {platform.python_version()}",
        "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), ""),
        "shared_with": a.shared_with, "load_average_at_start": os.getloadavg(), "other_processes_at_start": _others_cpu(),
        "server": {**br.server_stack(), "wrk": f"-t1 -c{a.connections}", "bundle": "shipped", "feedback": "none"},
        "redis": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip(),
    }
    try:
        res["pinned"] = (f"router event loop on core {ROUTER_CORE}; its log writer, redis-server, wrk and the bench "
                         f"on core {OTHERS_CORE}") if a.pin else None
        res["http"] = bench_http(work, redis_server.url, a.duration, a.rounds, a.connections,
                                 redis_server.proc.pid if redis_server.proc is not None else None, a.pin)

        async def state_ops() -> dict[str, Any]:
            shared = RedisState(redis_server.url, prefix="bench-ops")
            try:
                return {"embedded": await bench_state.bench(EmbeddedState(), a.state_n),
                        "redis": await bench_state.bench(shared, a.redis_n)}
            finally:
                await shared.close()

        res["state_ops"] = asyncio.run(state_ops())
    finally:
        redis_server.close()
        shutil.rmtree(work, ignore_errors=True)
    res["load_average_at_end"] = os.getloadavg()
    res["other_processes_at_end"] = _others_cpu()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {a.out}")


def table(res: dict[str, Any]) -> str:
    lines = [f"machine: {res['machine']} ({res['cpu']}); load average {res['load_average_at_start'][0]:.2f} at start, "
             f"{res['load_average_at_end'][0]:.2f} at end; shared with: {res['shared_with'] or 'not stated'}"
             + (f"; pinned: {res['pinned']}" if res.get("pinned") else ""), "",
             "| /v1/route (wrk " + res["server"]["wrk"] + ") | state | workers | req/s | per worker | vs trivial "
             "| vs embedded 1w | router CPU us/req (Redis's) | p50 ms | p99 ms (max) | non-2xx |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, v in res["http"].items():
        cpu = v.get("server_cpu_us_per_req", "")
        if v.get("redis_cpu_us_per_req") is not None:
            cpu = f"{cpu} ({v['redis_cpu_us_per_req']})"
        lines.append(f"| {label} ({v['policy']}) | {v['state']} | {v['workers']} | {v['rps']} | {v['per_worker_rps']} | "
                     f"{v['vs_trivial']} [{v['vs_trivial_range'][0]}-{v['vs_trivial_range'][1]}] | {v['vs_embedded_1w']} | "
                     f"{cpu} | {v['p50_ms']} | {v['p99_ms']} ({v['p99_ms_max']}) | {v['non_2xx']} |")
    lines += ["", "| state operation | embedded p50 / p99 us | Redis (loopback) p50 / p99 us |", "|---|---:|---:|"]
    ops = res["state_ops"]
    for op in ops["embedded"]:
        e, r = ops["embedded"][op], ops["redis"][op]
        lines.append(f"| {op} | {e['p50_us']} / {e['p99_us']} | {r['p50_us']} / {r['p99_us']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
