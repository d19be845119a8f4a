"""How long ``xroute serve`` takes to become ready, and what the start spends that time on.

Each start is a real ``python -m xroute_app serve`` on the embedded defaults -- the shipped
telemetry bundle, the SQLite decision log (one per checkout and worker count, kept from start to
start: a restart replays it), the model ``models:/xroute-router@champion`` from the MLflow store in
``runs/mlflow.db`` under the working directory (a champion registered there first: random weights
shaped like a trained router's, so loading it costs what loading a real one does; ``--no-model``:
none, the fallback) -- with ``--workers 1`` (the embedded state) and ``--workers 2`` (two workers
need the Redis state: a local ``redis-server``). Measured from the moment the process is spawned:

* ``ready_s``: until ``GET /readyz`` first answers 200 (polled every 10 ms);
* ``route_s``: until the first ``POST /v1/route`` then answers 200;
* ``cpu_s``: the CPU time the router's processes used until ready (user + system, the decision
  log's writer and the workers included): what the start costs whatever else runs on the machine;
* the phases of the start (``router.core.startup``: the ``start_s`` of the ``router ready`` log line --
  imports, settings, compiled kernels, telemetry, environment, decision log, policy store, model,
  state, ...) where the checkout logs them; for any checkout, from uvicorn's own log lines: until
  the serving process starts (``to_server_s``: for one worker the interpreter, the imports and the
  engine the command builds before serving; for two, the supervisor's own start and then a
  worker's) and its application start-up (``lifespan_s``).

Every checkout's starts get a fresh numba cache directory (``NUMBA_CACHE_DIR``), so the first start
of each (``cold``) compiles every kernel, as the first start after an install does, and the
others load them (reported as medians of ``--reps``). Starts are interleaved across checkouts and
worker counts, so a change in the machine's load falls on all alike; the load average is recorded.

Usage::

    .venv/bin/python benchmarks/bench_startup.py                                # this checkout
    .venv/bin/python benchmarks/bench_startup.py --checkout before=/path/to/other/checkout --checkout after=.
    .venv/bin/python benchmarks/bench_startup.py --workers 1 --reps 3 --no-model

Prints a markdown table and writes ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from router.control.keys import add_key  # noqa: E402
from tests.servers import RedisServer, descendants, free_port  # noqa: E402

ROUTE = {"origin": "aws:us-east-2", "input_tokens": 500, "max_output_tokens": 100, "ttft_ms": 2000, "tpot_ms": 100}
#: a start that has not answered by then failed
START_TIMEOUT_S = 180.0


def register_champion(workdir: Path) -> None:
    """``models:/xroute-router@champion`` in ``workdir/runs/mlflow.db``: random weights of a trained
    router's shape (``configs/train.yaml``: a 16-wide context, hidden 64 x 64, the reward prior)."""
    import itertools

    import mlflow
    import numpy as np
    import pandas as pd

    from envs.features import N_OFFERING_FEATURES, N_REQUEST_FEATURES
    from models import registry
    from models.loader import tracking_uri
    from models.policy import RewardPrior, RouterWeights, save_router
    from xroute.config import EnvConfig

    rng = np.random.default_rng(0)
    nx = N_OFFERING_FEATURES + N_REQUEST_FEATURES
    ctx = (rng.normal(0, 0.2, (nx, 16)).astype(np.float32), rng.normal(0, 0.1, 16).astype(np.float32))
    layers = [(rng.normal(0, 0.2, (a, b)).astype(np.float32), rng.normal(0, 0.1, b).astype(np.float32))
              for a, b in itertools.pairwise([nx + 16, 64, 64, 1])]
    weights = RouterWeights(layers=layers, ctx=ctx, prior=RewardPrior.from_env_config(EnvConfig()), margin=0.01)
    export = save_router(weights, workdir / "export")
    n = 5
    example = pd.DataFrame([{"request_id": "r0", "offerings": rng.uniform(0, 1.5, n * N_OFFERING_FEATURES),
                             "request": rng.uniform(0.2, 1.2, N_REQUEST_FEATURES), "mask": np.ones(n)}])
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exp = registry.setup(tracking_uri(), "bench-startup", workdir / "runs")
        with mlflow.start_run(experiment_id=exp):
            info = registry.log_router_model(export, example)
        version = registry.register(info.model_uri, "xroute-router", registry.CHAMPION)
    finally:
        os.chdir(cwd)
    print(f"registered models:/xroute-router@champion (version {version}) in {workdir / 'runs' / 'mlflow.db'}",
          flush=True)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process and every process below it have used so far: what a
    start costs whatever else the machine runs (``/proc``; processes already gone are not counted)."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            text = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # state is field 3: utime, stime are 14, 15
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _log_lines(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def start_once(checkout: Path, workers: int, workdir: Path, label: str, numba_dir: Path | None, keys: Path, key: str,
               redis_url: str | None, model: bool, n: int) -> dict[str, Any]:
    """One start of the checkout's ``xroute serve``: the times to ready and to the first decision,
    and the phases its log shows (``numba_dir``: numba's cache there; None: where numba keeps it)."""
    port = free_port()
    log = workdir / "logs" / f"{label}-w{workers}-{n}.log"
    log.parent.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(checkout), "MLFLOW_DISABLE_TELEMETRY": "true",
           "XROUTE_ROUTER_CONFIG": str(workdir / "router.yaml")}
    if numba_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(numba_dir)
    env.pop("MLFLOW_TRACKING_URI", None)  # the default store: runs/mlflow.db under the working directory
    if redis_url is not None:
        env.update({"XROUTE_ROUTER_STATE_BACKEND": "redis", "XROUTE_ROUTER_STATE_URL": redis_url,
                    "XROUTE_ROUTER_STATE_PREFIX": f"bench-{label}"})
    args = [sys.executable, "-m", "xroute_app", "serve", "--port", str(port), "--keys-file", str(keys),
            "--db", str(workdir / f"decisions-{label}-w{workers}.db"), "--workers", str(workers),
            *([] if model else ["--model", ""])]
    wall0 = time.time()
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    ready = route = None
    try:
        with httpx.Client(base_url=url, timeout=5.0) as client:
            while ready is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"{label}: xroute serve exited with {proc.returncode}: "
                                       f"{log.read_text(errors='replace')[-3000:]}")
                if time.monotonic() - t0 > START_TIMEOUT_S:
                    raise TimeoutError(f"{label}: not ready after {START_TIMEOUT_S:g} s: {log.read_text()[-3000:]}")
                try:
                    if client.get("/readyz", timeout=0.5).status_code == 200:
                        ready = time.monotonic() - t0
                        cpu = cpu_seconds(proc.pid)
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)
            while route is None:
                r = client.post("/v1/route", json=ROUTE, headers={"Authorization": f"Bearer {key}"})
                if r.status_code == 200:
                    route = time.monotonic() - t0
                    policy = r.json()["policy"]
                elif time.monotonic() - t0 > START_TIMEOUT_S:
                    raise RuntimeError(f"{label}: /v1/route answered {r.status_code}: {r.text[:500]}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = _log_lines(log)
    out: dict[str, Any] = {"ready_s": round(ready, 3), "route_s": round(route, 3), "cpu_s": round(cpu, 2),
                           "policy": policy["name"],
                           "policy_kind": policy["kind"]}
    # the serving process: the one whose application start-up ended first (a worker, or the one process)
    ready_lines = [x for x in lines if x.get("msg") == "router ready"]
    started = [x for x in lines if str(x.get("msg", "")).startswith("Started server process")]
    waiting = [x for x in lines if x.get("msg") == "Waiting for application startup."]
    if ready_lines and started and waiting:
        out["to_server_s"] = round(_epoch(started[0]["ts"]) - wall0, 3)
        out["lifespan_s"] = round(_epoch(ready_lines[0]["ts"]) - _epoch(waiting[0]["ts"]), 3)
        if "start_s" in ready_lines[0]:  # this checkout's own account of its start (router.core.startup)
            out["started_in_s"] = ready_lines[0]["started_in_s"]
            out["phases"] = ready_lines[0]["start_s"]
            if workers > 1:  # the supervisor's part: from spawn until the worker process began
                out["supervisor_s"] = round(ready - ready_lines[0]["started_in_s"], 3)
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(starts: list[dict[str, Any]]) -> dict[str, Any]:
    cold, warm = starts[0], starts[1:] or starts[:1]
    s: dict[str, Any] = {"cold_ready_s": cold["ready_s"], "cold_route_s": cold["route_s"]}
    for k in ("ready_s", "route_s", "cpu_s", "to_server_s", "lifespan_s", "started_in_s", "supervisor_s"):
        vals = [x[k] for x in warm if k in x]
        if vals:
            s[k] = _median(vals)
            if k in ("ready_s", "route_s"):
                s[k.replace("_s", "_min_s")] = min(vals)
                s[k.replace("_s", "_max_s")] = max(vals)
    phases = [x["phases"] for x in warm if "phases" in x]
    if phases:
        s["phases"] = {k: _median([p.get(k, 0.0) for p in phases]) for k in phases[0]}
    if "phases" in cold:
        s["cold_phases"] = cold["phases"]
    s["policy"] = sorted({x["policy_kind"] for x in starts})
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkout", action="append", default=None, metavar="LABEL=PATH",
                    help="a checkout whose code to start (repeat to compare; default: this one)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5, help="warm starts of each (after one cold start)")
    ap.add_argument("--no-model", action="store_true", help="no champion: serve the fallback")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "startup.json")
    a = ap.parse_args()
    checkouts: dict[str, Path] = {}
    for spec in a.checkout or [f"this={REPO}"]:
        label, _, path = spec.rpartition("=")
        checkouts[label or Path(path).name] = Path(path).resolve()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        workdir = Path(tmp)
        (workdir / "router.yaml").write_text("tenants:\n  acme: {}\n")
        keys = workdir / "keys.json"
        key = add_key(keys, "acme")
        if not a.no_model:
            register_champion(workdir)
        redis = RedisServer().start() if any(w > 1 for w in a.workers) else None
        try:
            runs: dict[str, list[dict[str, Any]]] = {}
            for rep in range(a.reps + 1):  # the first: cold numba caches
                for workers in a.workers:
                    for label, path in checkouts.items():
                        name = f"{label} w{workers}"
                        r = start_once(path, workers, workdir, label, workdir / f"numba-{label}", keys, key,
                                       redis.url if redis is not None and workers > 1 else None, not a.no_model, rep)
                        r["load_1m"] = round(os.getloadavg()[0], 2)
                        runs.setdefault(name, []).append(r)
                        print(f"  {name} #{rep}{' (cold)' if rep == 0 else ''}: ready {r['ready_s']:.2f} s, "
                              f"route {r['route_s']:.2f} s ({r['policy']}){' ' + json.dumps(r['phases']) if 'phases' in r else ''}",
                              flush=True)
        finally:
            if redis is not None:
                redis.close()
    load_after = os.getloadavg()
    summary = {name: summarize(starts) for name, starts in runs.items()}
    cols = ["start", "ready_s", "route_s", "ready min..max", "cpu_s", "cold_ready_s", "to_server_s", "lifespan_s",
            "supervisor_s"]
    print(f"\n{a.reps} warm starts each (medians) after one cold; nproc {os.cpu_count()}; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name, s in summary.items():
        print(f"| {name} | {s['ready_s']} | {s['route_s']} | {s['ready_min_s']}..{s['ready_max_s']} | {s['cpu_s']} | "
              f"{s['cold_ready_s']} | {s.get('to_server_s', '')} | {s.get('lifespan_s', '')} | "
              f"{s.get('supervisor_s', '')} |")
    for name, s in summary.items():
        if "phases" in s:
            print(f"\n{name}: where the start spends its time (median s; cold start in brackets)")
            print("| phase | s | cold |")
            print("|---|---|---|")
            for k, v in s["phases"].items():
                print(f"| {k} | {v} | {s.get('cold_phases', {}).get(k, '')} |")
    meta = {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "checkouts": {k: str(v) for k, v in checkouts.items()}, "reps": a.reps, "model": not a.no_model,
            "note": "ready_s: spawn to the first 200 of /readyz; route_s: to the first 200 of /v1/route; medians of "
                    "the warm starts (numba's cache filled by the cold first start); the machine shared with other "
                    "work while measured (load average)",
            "when": datetime.now(UTC).isoformat(timespec="seconds")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
