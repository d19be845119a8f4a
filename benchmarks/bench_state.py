"""The router state's own operations (``router/service/ports.py``): p50/p99 per call, for both backends.

Each operation is awaited one at a time on one event loop (what a request's task pays; no
pipelining), timed with ``perf_counter`` around the ``await``: admit (a ranked list of 4 candidate
pools, the first full: the first with room taken), settle (the reservation released), settle of an
outcome (one outcome into the EWMA statistics, nothing held), lookup (a prompt of 8 blocks and a
session, nothing recorded), idempotency claim of a new key, complete, claim of a completed key,
and the view (in-flight work and expiries). The embedded backend in this process; the Redis backend against a real
``redis-server`` started on a loopback port for the run (``tests/servers.py``; no persistence),
through redis-py's asyncio client with hiredis. Targets (issue 17): embedded p99 <= 20 us, Redis
over loopback p99 <= 1 ms.

Usage::

    sudo apt-get install redis-server          # scripts/setup.sh does, for the tests
    .venv/bin/python benchmarks/bench_state.py [--n 20000 --redis-n 5000]

Prints a markdown table and writes ``benchmarks/results/state.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from router.state.base import Admission, PoolOutcome, Settlement  # noqa: E402
from router.state.embedded import EmbeddedState  # noqa: E402

CANDIDATES = [(f"pool-{i}", 1_000_000) for i in range(3)]


async def _time(n: int, op: Callable[[int], Awaitable[Any]]) -> dict[str, float]:
    ts = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        await op(i)
        ts[i] = time.perf_counter() - t0
    ts = ts[min(200, n // 10):] * 1e6  # the first calls warm caches and connections
    return {"p50_us": round(float(np.percentile(ts, 50)), 1), "p99_us": round(float(np.percentile(ts, 99)), 1),
            "mean_us": round(float(ts.mean()), 1), "calls": int(ts.size)}


async def bench(state: Any, n: int) -> dict[str, dict[str, float]]:
    full = [("full", 0), *CANDIDATES]  # the first candidate never has room: the script walks on
    hashes = np.arange(1, 9, dtype=np.int64)
    out = {
        "admit": await _time(n, lambda i: state.admit(Admission(f"r{i}", full, 300))),
        "settle": await _time(n, lambda i: state.settle(Settlement(f"r{i}"))),
        "settle_outcome": await _time(n, lambda i: state.settle(Settlement(f"o{i}", release=False, outcome=PoolOutcome(
            "pool-0", 100.0 + i % 50, 2000.0 + i % 300, i % 20 == 0)))),
        "lookup": await _time(n, lambda i: state.lookup(hashes, f"s{i % 100}", 600.0)),
        "claim_new": await _time(n, lambda i: state.claim(f"k{i}", 300)),
        "complete": await _time(n, lambda i: state.complete(f"k{i}", b'{"decision_id":"d_x"}' * 60, 300)),
        "claim_done": await _time(n, lambda i: state.claim(f"k{i}", 300)),
        "view": await _time(n, lambda i: state.view()),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="calls per operation, embedded backend (>= 1000)")
    ap.add_argument("--redis-n", type=int, default=5000, help="calls per operation, Redis backend (>= 1000)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "state.json")
    a = ap.parse_args()
    for name, v in (("--n", a.n), ("--redis-n", a.redis_n)):
        if v < 1000:
            ap.error(f"{name} must be at least 1000 (got {v})")
    from router.state.redis import RedisState
    from tests.servers import RedisServer, ServerError

    res: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (nproc), Python "
                                      f"{platform.python_version()}", "load_average_at_start": os.getloadavg()}

    async def run_embedded() -> dict[str, dict[str, float]]:
        return await bench(EmbeddedState(), a.n)

    res["embedded"] = asyncio.run(run_embedded())
    try:
        server = RedisServer().start()
    except ServerError as e:
        sys.exit(f"bench_state: error: {e}")
    try:
        async def run_redis() -> dict[str, dict[str, float]]:
            state = RedisState(server.url, prefix="bench")
            try:
                return await bench(state, a.redis_n)
            finally:
                await state.close()

        res["redis"] = asyncio.run(run_redis())
        res["redis_server"] = "redis-server on 127.0.0.1 (loopback), no persistence"
    finally:
        server.close()
    res["load_average_at_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    lines = [f"machine: {res['machine']}; load average {res['load_average_at_start'][0]:.2f} at start", "",
             "| operation | embedded p50 / p99 us | Redis (loopback) p50 / p99 us |", "|---|---:|---:|"]
    for op in res["embedded"]:
        e, r = res["embedded"][op], res["redis"][op]
        lines.append(f"| {op} | {e['p50_us']} / {e['p99_us']} | {r['p50_us']} / {r['p99_us']} |")
    print("\n".join(lines))
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
