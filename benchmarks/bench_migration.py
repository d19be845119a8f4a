"""Migration off a preempted pool (``docs/migration.md``): how fast the router moves sessions.

For each session count: a fresh ``xroute serve`` (one worker, greedy, the tiny test bundle with
queues long enough for every session, SQLite log with ``synchronous=FULL``, embedded state) places
that many sessions on one spot pool, then gets one interruption notice for the pool (deadline two
minutes ahead). A serving side of ``--clients`` threads announces and verifies each session's
snapshot as soon as its target is chosen: by default it lists the event's migrations
(``GET /v1/events/{id}/migrations``) and announces and verifies ``--batch`` sessions a call
(``POST /v1/sessions/snapshots``, ``/verifications``); ``--batch 0`` makes one ``GET
/v1/sessions/{id}``, one snapshot and one verify call per session (the single-session routes).
Measured:

* ``accept_ms``: ``POST /v1/events`` (the event durable, the pool masked, every migration created
  durable) -- the call's wall time;
* ``targets_s``: until every migration has its target (the router alone: a live decision per
  session, its transition durable), read from the log;
* ``committed_s``: until every migration is committed (the serving side's snapshot and verify
  calls included), read from the log; ``migrations_per_s`` = sessions / committed_s;
* ``snapshot_ms``/``verify_ms`` p50/p99: one call each (a durable transition; verify two) -- with
  ``--batch`` (the default, 200), one batch call of that many sessions each;
* against the notice windows: whether ``committed_s`` fits 30 s (Azure, GCP) and 120 s (AWS), and
  ``missed_window``: the migrations the router committed cold at the deadline (work recomputed at
  the target) because the serving side had not verified their snapshot by then.

Usage::

    .venv/bin/python benchmarks/bench_migration.py                    # 100 and 1,000 sessions (~2 min)
    .venv/bin/python benchmarks/bench_migration.py --sessions 100 1000 10000
    .venv/bin/python benchmarks/bench_migration.py --sessions 10000 --batch 0 --clients 32   # per session

Prints a markdown table and writes ``benchmarks/results/migration.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sqlite3
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from router.control.keys import add_key  # noqa: E402
from tests.servers import free_port, start_subprocess  # noqa: E402
from tests.test_router_support import ROUTE, make_setup  # noqa: E402

POOL = "aws:us-east-1:g5.xlarge:spot"


def _count(db: Path, where: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return int(conn.execute(f"SELECT COUNT(*) FROM migrations WHERE {where}").fetchone()[0])


def run(n: int, clients: int, root: Path, batch: int = 0) -> dict[str, Any]:
    setup = make_setup(root)
    events_key = add_key(setup.settings.keys_file, "ops", "events")
    port = free_port()
    env = {"XROUTE_ROUTER_ENV__SERVING_CONFIG": str(root / "serving.yaml"),
           "XROUTE_ROUTER_ENV__QUEUE_TIMEOUT_S": "3600", "XROUTE_ROUTER_CONFIG": str(root / "router.yaml"),
           "XROUTE_ROUTER_STATE_HOLD_FLOOR_S": "600", "XROUTE_ROUTER_MIGRATION_POLL_S": "0.05",
           # the tiny bundle's replay clock slowed 20x: its spot pool goes unavailable ~20 s into
           # the replay, which placing 10,000 sessions at x1 outlasted
           "XROUTE_ROUTER_REPLAY_SPEED": "0.05"}
    args = ["--telemetry", str(root / "bundle"), "--db", str(root / "decisions.db"), "--keys-file",
            str(root / "keys.json"), "--model", "", "--log-level", "WARNING"]
    proc = start_subprocess(args, env, port, root / "server.log")
    url = f"http://127.0.0.1:{port}"
    A, E = setup.auth("a"), {"Authorization": f"Bearer {events_key}"}
    sessions = [f"s{i:06d}" for i in range(n)]
    try:
        def place(part: list[str]) -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                for s in part:
                    d = c.post("/v1/route", headers=A, json={**ROUTE, "session_id": s, "constraints": {
                        "prefer": [{"offering_ids": [POOL]}]}}).json()
                    assert d["offering"]["offering_id"] == POOL, d
                    c.post("/v1/feedback", headers=A, json={"decision_id": d["decision_id"], "latency_ms": 50})

        failures: list[BaseException] = []

        def place_all(part: list[str]) -> None:
            try:
                place(part)
            except BaseException as e:  # a client thread's failure fails the run, not just its thread
                failures.append(e)

        threads = [threading.Thread(target=place_all, args=(sessions[k::clients],)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        snap_ms: list[float] = []
        verify_ms: list[float] = []
        lock = threading.Lock()

        def serve(part: list[str]) -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                todo = list(part)
                while todo:
                    later = []
                    for s in todo:
                        m = c.get(f"/v1/sessions/{s}?tenant=a", headers=E).json()["migration"]
                        if m is None or m["state"] == "requested":
                            later.append(s)
                            continue
                        if m["state"] == "committed":  # committed cold at its deadline (missed its window)
                            continue
                        digest = hashlib.sha256(s.encode()).hexdigest()
                        t0 = time.perf_counter()
                        r = c.post(f"/v1/sessions/{s}/snapshot?tenant=a", headers=E, json={
                            "migration_id": m["migration_id"], "version": m["version"], "last_ack_seq": 1,
                            "sha256": digest, "uri": f"s3://bench/{s}"})
                        t1 = time.perf_counter()
                        if r.status_code == 409 and r.json()["migration"]["state"] == "committed":
                            continue  # the deadline came first: the router committed it cold
                        assert r.status_code == 200, r.text
                        r = c.post(f"/v1/sessions/{s}/verify?tenant=a", headers=E, json={
                            "migration_id": m["migration_id"], "target": m["target"], "sha256": digest})
                        t2 = time.perf_counter()
                        if r.status_code == 409 and r.json()["migration"]["state"] == "committed":
                            continue
                        assert r.status_code == 200 and r.json()["state"] == "committed", r.text
                        with lock:
                            snap_ms.append(1000 * (t1 - t0))
                            verify_ms.append(1000 * (t2 - t1))
                    todo = later
                    if todo:
                        time.sleep(0.01)

        def serve_batched(batch: int) -> None:
            """The serving side of the whole pool: a lister reads the event's migrations with a target
            (``GET /v1/events/{id}/migrations``, pages of 1,000) and hands them out in chunks of
            ``batch``; ``clients`` threads announce a chunk's snapshots in one call and verify them in
            another (``POST /v1/sessions/snapshots``, ``/verifications``)."""
            import queue

            chunks: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
            sent: set[str] = set()

            def lister() -> None:
                with httpx.Client(base_url=url, timeout=60) as c:
                    while _count(db, "state = 'committed'") < n:
                        after, fresh = "", []
                        while True:
                            page = c.get("/v1/events/bench/migrations", headers=E, params={
                                "state": "target_chosen", "after": after, "limit": 1000}).json()
                            fresh += [m for m in page["migrations"] if m["migration_id"] not in sent]
                            if page["next_after"] is None:
                                break
                            after = page["next_after"]
                        for k in range(0, len(fresh), batch):
                            part = fresh[k:k + batch]
                            sent.update(m["migration_id"] for m in part)
                            chunks.put(part)
                        if not fresh:
                            time.sleep(0.02)
                for _ in range(clients):
                    chunks.put(None)

            def worker() -> None:
                with httpx.Client(base_url=url, timeout=60) as c:
                    while (part := chunks.get()) is not None:
                        items = [{"session_id": m["session_id"], "tenant": "a", "migration_id": m["migration_id"],
                                  "version": m["version"], "last_ack_seq": 1,
                                  "sha256": hashlib.sha256(m["session_id"].encode()).hexdigest(),
                                  "uri": f"s3://bench/{m['session_id']}"} for m in part]
                        t0 = time.perf_counter()
                        r = c.post("/v1/sessions/snapshots", headers=E, json={"items": items})
                        t1 = time.perf_counter()
                        assert r.status_code == 200, r.text
                        ok = {x["session_id"] for x in r.json()["results"] if x["status"] == 200}
                        ver = [{"session_id": m["session_id"], "tenant": "a", "migration_id": m["migration_id"],
                                "target": m["target"], "sha256": hashlib.sha256(m["session_id"].encode()).hexdigest()}
                               for m in part if m["session_id"] in ok]  # (others: committed cold meanwhile)
                        if not ver:
                            continue
                        r = c.post("/v1/sessions/verifications", headers=E, json={"items": ver})
                        t2 = time.perf_counter()
                        assert r.status_code == 200, r.text
                        with lock:
                            snap_ms.append(1000 * (t1 - t0))
                            verify_ms.append(1000 * (t2 - t1))

            threads = [threading.Thread(target=lister), *(threading.Thread(target=worker) for _ in range(clients))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        db = root / "decisions.db"
        with httpx.Client(base_url=url, timeout=120) as c:
            t0 = time.perf_counter()
            r = c.post("/v1/events", headers=E, json={"event_id": "bench", "kind": "interruption", "pool": POOL,
                                                      "deadline": (datetime.now(UTC) + timedelta(seconds=120)).isoformat()})
            accept = time.perf_counter() - t0
            assert r.status_code == 200 and r.json()["migrations"] == n, r.text
        workers = ([threading.Thread(target=serve_batched, args=(batch,))] if batch else
                   [threading.Thread(target=serve, args=(sessions[k::clients],)) for k in range(clients)])
        for w in workers:
            w.start()
        targets_s = committed_s = None
        while committed_s is None:
            time.sleep(0.02)
            now = time.perf_counter() - t0
            if targets_s is None and _count(db, "state != 'requested'") == n:
                targets_s = now
            if _count(db, "state = 'committed'") == n:
                committed_s = now
                targets_s = targets_s or now
        for w in workers:
            w.join()
        assert targets_s is not None
        return {"sessions": n, "clients": clients, "batch": batch, "accept_ms": round(1000 * accept, 1), "targets_s": round(targets_s, 2),
                "committed_s": round(committed_s, 2), "migrations_per_s": round(n / committed_s, 1),
                "snapshot_ms_p50": round(float(np.percentile(snap_ms, 50)), 2),
                "snapshot_ms_p99": round(float(np.percentile(snap_ms, 99)), 2),
                "verify_ms_p50": round(float(np.percentile(verify_ms, 50)), 2),
                "verify_ms_p99": round(float(np.percentile(verify_ms, 99)), 2),
                "missed_window": _count(db, "missed_window = 1"),
                "fits_30s": committed_s <= 30.0, "fits_120s": committed_s <= 120.0}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--clients", type=int, default=8, help="serving-side threads")
    ap.add_argument("--batch", type=int, default=200, help="sessions per snapshot / verification call (the batch "
                    "routes); 0: one GET, snapshot and verify call per session (the single-session routes)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "migration.json")
    a = ap.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    rows = []
    for n in a.sessions:
        with tempfile.TemporaryDirectory(prefix="bench_migration_") as tmp:
            rows.append(run(n, a.clients, Path(tmp), a.batch))
        print(f"  {rows[-1]}", flush=True)
    cols = ["sessions", "clients", "batch", "accept_ms", "targets_s", "committed_s", "migrations_per_s", "missed_window", "snapshot_ms_p50",
            "snapshot_ms_p99", "verify_ms_p50", "verify_ms_p99", "fits_30s", "fits_120s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    meta = {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "note": "one router worker (SQLite FULL, embedded state) and the serving-side clients on the same "
                    "machine, shared with other work while measured",
            "when": datetime.now(UTC).isoformat(timespec="seconds")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
