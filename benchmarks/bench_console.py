"""The web console's pages with 100k decisions in the log (``docs/console.md``, "How fast").

1. **Seed**: a router (uvicorn in this process) decides a few hundred real requests of tenants ``a``
   and ``b`` over HTTP (their answers as the engine wrote them), two policy versions and a pool event
   go in through the admin API, and a canary is started (half the requests); then ``--decisions``
   decisions made from those answers -- new time-sorted ids, spread over the last day, 500 sessions per
   tenant, every other one in the canary's arm -- are written through the real decision log (``router.store.sqlite.DecisionStore``: its writer process, group commits).
2. **Time**: ``xroute serve`` in a subprocess on that log; each page fetched ``--rounds`` times over
   HTTP with keep-alive (pages interleaved round by round), median and p95 wall time of the whole
   response per page, as an admin key and as a tenant key.

Usage::

    .venv/bin/python benchmarks/bench_console.py                     # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_console.py --decisions 20000 --rounds 10

Writes ``benchmarks/results/console.json`` and prints a table (with ``nproc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROUTE = {"origin": "aws:us-east-1", "input_tokens": 400, "max_output_tokens": 80, "ttft_ms": 2500, "tpot_ms": 100}
SESSIONS = 500


def seed_answers(setup: Any, n: int) -> tuple[list[tuple[str, dict[str, Any], dict[str, Any]]], str]:
    """``n`` real decisions per tenant (tenant, request, answer), two policy versions, a pool event, and a
    canary running (its id returned)."""
    import httpx

    from router.app.factory import create_app
    from tests.servers import ServerThread

    out = []
    with ServerThread(create_app(setup.settings)) as url, httpx.Client(base_url=url, timeout=30) as c:
        for tenant in ("a", "b"):
            for i in range(n):
                req = {**ROUTE, "session_id": f"{tenant}-s{i % SESSIONS}", "input_tokens": 200 + i % 400}
                r = c.post("/v1/route", json=req, headers=setup.auth(tenant))
                r.raise_for_status()
                out.append((tenant, req, r.json()))
        admin = setup.auth("admin")
        for w in (0.5, 0.75):
            c.put("/v1/admin/policies/prefer-on-demand", json={"effect": "prefer", "weight": w,
                                                                "constraints": {"pricing_modes": ["on_demand"]}},
                  headers=admin).raise_for_status()
        pool = c.get("/v1/offerings", headers=admin).json()["offerings"][-1]["offering"]["offering_id"]
        c.post("/v1/events", json={"event_id": "bench-1", "kind": "degraded", "pool": pool},
               headers=admin).raise_for_status()
        r = c.post("/v1/admin/canary", json={"put": [{"name": "bench-no-spot", "effect": "deny",
                                                      "constraints": {"pricing_modes": ["spot"]}}],
                                             "key": "request", "share": 50}, headers=admin)
        r.raise_for_status()
    return out, str(r.json()["canary"]["id"])


async def write_log(path: Path, answers: list[tuple[str, dict[str, Any], dict[str, Any]]], n: int,
                    canary: str) -> float:
    """``n`` decisions from ``answers`` through the real decision log, every other one in the canary's arm;
    returns the seconds it took."""
    from router.store.rows import DecisionRow
    from router.store.sqlite import DecisionStore

    store = DecisionStore(path, synchronous="NORMAL")
    store.start()
    rng = random.Random(7)
    now = time.time()
    times = sorted(now - 86_400.0 + 86_000.0 * rng.random() for _ in range(n))
    t0 = time.perf_counter()
    batch: list[Any] = []
    for k, at in enumerate(times):
        tenant, req, ans = answers[k % len(answers)]
        did = f"d_{int(at * 1000):012x}{rng.getrandbits(80):020x}"
        session = f"{tenant}-s{rng.randrange(SESSIONS)}"
        req = {**req, "session_id": session}
        ans = {**ans, "decision_id": did, "session_id": session,
               "created_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"}
        off = ans["offering"]["offering_id"]
        row = DecisionRow(did, tenant, at, at, req["origin"], req["input_tokens"], req["max_output_tokens"],
                          req["ttft_ms"], req["tpot_ms"], None, "llama-2-7b", session, off, ans["expected_latency_ms"],
                          ans["expected_cost_usd"], ans["policy"]["name"], ans["policy"]["kind"],
                          ans["policy"].get("version"), "bench", None, None, None, None, None, None,
                          req["input_tokens"] + req["max_output_tokens"] if tenant == "a" else None,
                          ans["expected_cost_usd"] if tenant == "a" else None, json.dumps(req), json.dumps(ans))
        row.policy_arm = f"{'canary' if k % 2 else 'stable'}:{canary}"
        batch.append(store.record_decision(row))
        if len(batch) >= 2000:
            await asyncio.gather(*batch)
            batch = []
    await asyncio.gather(*batch)
    took = time.perf_counter() - t0
    await store.close()
    return took


def pages(ids: list[str], cursor: str, pool_tenant_session: str) -> list[tuple[str, str, str, dict[str, str] | None]]:
    """(name, key, path, form) of every page timed."""
    mid = ids[len(ids) // 2]
    t_mid = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(time.time() - 12 * 3600))
    t_end = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(time.time() - 11 * 3600))
    return [
        ("pools", "admin", "/console/pools", None),
        ("decisions (newest 50)", "admin", "/console/decisions", None),
        ("decisions (tenant)", "admin", "/console/decisions?tenant=a", None),
        ("decisions (tenant, session)", "admin", f"/console/decisions?tenant=a&session={pool_tenant_session}", None),
        ("decisions (1 h window)", "admin", f"/console/decisions?since={t_mid}&until={t_end}", None),
        ("decisions (page deep in the log)", "admin", f"/console/decisions?before={cursor}", None),
        ("decisions (tenant key)", "a", "/console/decisions?limit=200", None),
        ("one decision", "admin", f"/console/decisions/{mid}", None),
        ("policies (a canary: 2 x 10,000 compared)", "admin", "/console/policies", None),
        ("policies (diff v1 v2)", "admin", "/console/policies?a=1&b=2", None),
        ("policies (dry run, 200)", "admin", "/console/policies/dry-run",
         {"draft": "name: no-spot\neffect: deny\nconstraints: {pricing_modes: [spot]}\n", "last": "200"}),
        ("tenants (a: 24 h)", "admin", "/console/tenants?tenant=a", None),
        ("tenants (tenant key)", "b", "/console/tenants", None),
        ("model", "admin", "/console/model", None),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=100_000)
    ap.add_argument("--seed-requests", type=int, default=200, help="real decisions per tenant the log is made from")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "console.json")
    args = ap.parse_args()

    import httpx

    from router.console.auth import csrf_token
    from router.store.dialect import reading
    from tests.servers import free_port, start_subprocess
    from tests.test_router_support import make_setup

    work = Path(tempfile.mkdtemp(prefix="xroute-bench-console-"))
    setup = make_setup(work, tenants={"a": {"quotas": {"max_concurrent": 500, "requests_per_day": 1_000_000}}})
    answers, canary = seed_answers(setup, args.seed_requests)
    db = Path(setup.settings.db_path)
    took = asyncio.run(write_log(db, answers, args.decisions, canary))
    with reading(db) as q:
        total = q("SELECT COUNT(*) FROM decisions")[0][0]
        ids = [r[0] for r in q("SELECT decision_id FROM decisions ORDER BY decision_id LIMIT 1 OFFSET ?",
                               (total // 2,))]
        row = q("SELECT created_at, decision_id FROM decisions WHERE decision_id = ?", (ids[0],))[0]
        session = q("SELECT session_id FROM decisions WHERE tenant = 'a' AND session_id IS NOT NULL "
                    "ORDER BY decision_id DESC LIMIT 1")[0][0]
    cursor = f"{row[0]!r}_{row[1]}"
    print(f"log: {total} decisions ({args.decisions} written through the decision log in {took:.1f} s)")

    port = free_port()
    env = {"XROUTE_ROUTER_ENV__SERVING_CONFIG": str(work / "serving.yaml"), "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = start_subprocess(["--config", str(work / "router.yaml"), "--telemetry", str(work / "bundle"), "--db",
                               str(db), "--keys-file", str(setup.settings.keys_file), "--model", "",
                               "--log-level", "WARNING"], env, port, work / "server.log", timeout=180)
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            plan = pages(ids, cursor, session)
            for rnd in range(args.rounds + 1):
                for name, who, path, form in plan:
                    h = setup.auth(who)
                    t0 = time.perf_counter()
                    if form is None:
                        r = c.get(path, headers=h)
                    else:
                        r = c.post(path, data={**form, "csrf": csrf_token(setup.keys[who])}, headers=h)
                    dt = time.perf_counter() - t0
                    if r.status_code != 200:
                        raise SystemExit(f"{name}: {r.status_code} {r.text[:300]}")
                    if rnd > 0:  # (round 0 warms the caches: templates compiled, the registry read)
                        times.setdefault(name, []).append(dt)
                        sizes[name] = len(r.content)
    finally:
        server.terminate()
        server.wait(30)

    rows = []
    for name, _, _, _ in plan:
        a = np.asarray(times[name]) * 1000.0
        rows.append({"page": name, "median_ms": round(float(np.median(a)), 2),
                     "p95_ms": round(float(np.percentile(a, 95)), 2), "max_ms": round(float(a.max()), 2),
                     "bytes": sizes[name], "n": int(a.size)})
    nproc = os.cpu_count()
    print(f"\nconsole pages, {total} decisions in the log, {args.rounds} rounds, nproc={nproc}")
    print(f"{'page':42s} {'median ms':>10s} {'p95 ms':>8s} {'max ms':>8s} {'bytes':>8s}")
    for r in rows:
        print(f"{r['page']:42s} {r['median_ms']:10.1f} {r['p95_ms']:8.1f} {r['max_ms']:8.1f} {r['bytes']:8d}")
    worst = max(r["p95_ms"] for r in rows)
    print(f"\nslowest p95: {worst:.1f} ms (target: every page under 300 ms)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "benchmark": "console", "decisions": int(total), "rounds": args.rounds, "nproc": nproc,
        "python": platform.python_version(), "machine": platform.machine(),
        "seeded_s": round(took, 2), "pages": rows, "slowest_p95_ms": worst,
        "command": "python benchmarks/bench_console.py " + " ".join(sys.argv[1:])}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
