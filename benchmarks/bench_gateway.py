"""The gateway's overhead, side by side in one run: the same load sent straight to a vLLM-like
stand-in (``tests/vllm_standin.py``, its own process) and through the gateway (``xroute serve``,
one worker, its defaults: SQLite decision log with ``synchronous=FULL``, access log, embedded
state, the greedy fallback deciding over the shipped bundle's 96 offerings, every one of them an
upstream on the stand-in).

1. Streams: ``--streams`` (200) concurrent streamed chat completions, each worker sending its next
   as soon as one ends, ``--stream-tokens`` tokens at ``--tpot-ms`` after ``--ttft-ms`` (the
   stand-in's). TTFT as the client sees it (request sent -> first token read), direct and through
   the gateway in alternating phases (``--rounds``); the added TTFT is each round's gateway
   percentile minus its direct one, the median over rounds reported. The first second of each
   phase is warm-up, not counted.
2. Not streamed: ``wrk`` (one thread, ``--rps-conns`` connections) against a stand-in answering
   at once (16 tokens), direct and through the gateway (``--rounds`` alternating pairs): requests
   per second, latency p50/p99, and the gateway's CPU time per request (its event loop and its
   decision-log writer).
3. Memory per open stream: the gateway's RSS (and its writer's) idle, then with ``--hold``
   streams open (the stand-in sending one token a second), divided by the streams.

LiteLLM's published proxy figures, for comparison, are in :data:`LITELLM` with their sources.

Usage::

    sudo apt-get install wrk
    .venv/bin/python benchmarks/bench_gateway.py              # ~4 min
    .venv/bin/python benchmarks/bench_gateway.py --rounds 1 --stream-s 10 --rps-s 8   # a quick look

Writes ``benchmarks/results/gateway.json`` and prints a markdown table. The machine's core count
and load average are recorded with the figures: on a shared machine the load generator, the
stand-in, the gateway and its writer share the cores, so the absolute figures move with the
neighbours; the side-by-side ratios and differences less so.
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
import httpx  # noqa: E402
import numpy as np  # noqa: E402

from tests.servers import free_port, start_subprocess  # noqa: E402

MODEL = "llama-2-7b"
ORIGIN = "aws:us-east-1"
#: LiteLLM's own published proxy figures (fetched 2026-12; the pages say how they measured)
LITELLM = [
    {"source": "https://docs.litellm.ai/docs/benchmarks (2 instances, 4 CPU / 8 GB each, Locust 1,000 users, "
               "fake OpenAI endpoint, PostgreSQL)",
     "rps": 1035.7, "overhead_p50_ms": 12, "overhead_p95_ms": 29, "overhead_p99_ms": 43, "cpus": 8},
    {"source": "https://docs.litellm.ai/docs/benchmarks (4 instances, 4 CPU / 8 GB each)",
     "rps": 1170, "overhead_p50_ms": 2, "overhead_p95_ms": 8, "overhead_p99_ms": 13, "cpus": 16},
    {"source": "an earlier revision of https://docs.litellm.ai/docs/benchmarks (1 instance, 2 CPU / 4 GB)",
     "rps": 475, "overhead_p50_ms": 3, "overhead_p90_ms": 17, "overhead_p99_ms": 31, "cpus": 2},
    {"source": "https://docs.litellm.ai/docs/proxy/perf (latency added against the raw OpenAI API)",
     "overhead_mean_ms": 3.25},
]


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs)
    return {"n": int(a.size), "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "mean_ms": round(float(a.mean()), 3)}


def _rss_kib(pid: int) -> int:
    return br._rss_kib(pid)


# ------------------------------------------------------------------------------------------------ load
async def _streams(url: str, headers: dict[str, str], body: bytes, workers: int, seconds: float,
                   warmup_s: float = 1.0) -> dict[str, Any]:
    """``workers`` concurrent streams for ``seconds``: the TTFT and duration of each (after the warm-up)."""
    import aiohttp

    ttft: list[float] = []
    total: list[float] = []
    overhead: list[float] = []  # the gateway's own measure of what it added (its x-xroute-overhead-ms header)
    errors: dict[str, int] = {}
    stream = b'"stream": true' in body or b'"stream":true' in body
    start = time.perf_counter()
    stop = start + seconds
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                first = None
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        if r.status != 200:
                            await r.read()
                            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                            await asyncio.sleep(0.05)
                            continue
                        added = r.headers.get("x-xroute-overhead-ms")
                        if not stream:
                            await r.read()
                            first = time.perf_counter()
                        else:
                            async for line in r.content:
                                if first is None and b"tok0" in line:
                                    first = time.perf_counter()
                                if line.startswith(b"data: [DONE]"):
                                    break
                except Exception as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    continue
                end = time.perf_counter()
                if first is not None and t0 >= start + warmup_s:
                    ttft.append((first - t0) * 1000.0)
                    total.append((end - t0) * 1000.0)
                    if added is not None:
                        overhead.append(float(added))

        await asyncio.gather(*(worker() for _ in range(workers)))
    out = {"ttft": _pct(ttft), "duration": _pct(total), "errors": errors,
           "streams_per_s": round(len(ttft) / max(seconds - warmup_s, 1e-9), 1)}
    if overhead:
        out["gateway_overhead"] = _pct(overhead)
    return out


async def _hold(url: str, headers: dict[str, str], body: bytes, n: int, pid: int, writer_pid: int | None
                ) -> dict[str, Any]:
    """Open ``n`` streams, read each one's first token, measure the server's RSS, close them."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    opened: list[Any] = []
    errors = 0
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one() -> None:
            nonlocal errors
            try:
                r = await session.post(url, data=body, headers=headers)
                if r.status != 200:
                    errors += 1
                    r.release()
                    return
                async for line in r.content:
                    if b"tok0" in line:
                        break
                opened.append(r)
            except Exception:
                errors += 1

        for i in range(0, n, 50):  # in waves: the connection setup is not what is measured
            await asyncio.gather(*(one() for _ in range(min(50, n - i))))
        await asyncio.sleep(1.0)
        rss = _rss_kib(pid)
        wrss = _rss_kib(writer_pid) if writer_pid else 0
        for r in opened:
            r.close()
    return {"opened": len(opened), "errors": errors, "rss_kib": rss, "writer_rss_kib": wrss}


def _admin(standin: str, **config: Any) -> None:
    httpx.post(f"{standin}/admin/config", json=config, timeout=10).raise_for_status()


def _wrk_lua(path: Path, body: dict[str, Any], key: str | None) -> Path:
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"',
             f"wrk.body = {json.dumps(json.dumps(body))}"]
    if key:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {key}"')
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ setup
def _config(work: Path, standin: str, name: str) -> Path:
    import pandas as pd

    offerings = pd.read_csv(REPO / "data" / "bundles" / "default" / "offerings.csv")["offering_id"].tolist()
    cfg = {"upstreams": [{"offering_id": o, "base_urls": [f"{standin}/v1"]} for o in offerings],
           "gateway": {"origin": ORIGIN, "max_connections": 4096},
           "model_uri": "", "model_poll_s": 0, "log_level": "WARNING", "db_path": str(work / f"{name}.db"),
           "replay_speed": 1.0, "tenants": {"bench": {}}}  # (the key's tenant, declared)
    path = work / f"{name}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


async def _client_cost(url: str, n: int) -> dict[str, float]:
    """CPU microseconds per request (and wall) of httpx's and aiohttp's clients, sequential POSTs
    of one not-streamed chat completion to the stand-in: what forwarding one request costs the
    gateway's event loop in its HTTP client alone."""
    import aiohttp

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).encode()
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    out: dict[str, float] = {}
    async with httpx.AsyncClient(trust_env=False) as hc, aiohttp.ClientSession(auto_decompress=False) as ac:

        async def via_httpx() -> None:
            await hc.post(url, content=body, headers=headers)

        async def via_aiohttp() -> None:
            async with ac.post(url, data=body, headers=headers) as r:
                await r.read()

        for name, one in (("httpx", via_httpx), ("aiohttp", via_aiohttp)) * 2:
            for _ in range(50):
                await one()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                await one()
            cpu, wall = (time.process_time() - c0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6
            out[f"{name}_cpu_us"] = round(min(out.get(f"{name}_cpu_us", 1e9), cpu), 1)
            out[f"{name}_wall_us"] = round(min(out.get(f"{name}_wall_us", 1e9), wall), 1)
    return out


class Gateway:
    """``xroute serve`` with every offering of the shipped bundle an upstream on the stand-in."""

    def __init__(self, work: Path, standin: str, key_file: Path, name: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.proc = start_subprocess(["--config", str(_config(work, standin, name)), "--keys-file", str(key_file)],
                                     env or {}, self.port, work / f"{name}.log")
        self.url = f"http://127.0.0.1:{self.port}"
        writers = br.child_pids(self.proc.pid)
        self.writer = writers[0] if writers else None

    def cpu_s(self) -> float:
        own, children = br._cpu_s(self.proc.pid)  # type: ignore[attr-defined]
        return own + children

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--ttft-ms", type=float, default=100.0)
    ap.add_argument("--tpot-ms", type=float, default=40.0)
    ap.add_argument("--stream-s", type=float, default=20.0, help="seconds per streaming phase")
    ap.add_argument("--rps-s", type=float, default=15.0, help="seconds per wrk run")
    ap.add_argument("--rps-conns", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hold", type=int, default=500, help="streams held open for the memory figure")
    ap.add_argument("--db-synchronous", choices=["FULL", "NORMAL"], default="FULL",
                    help="the decision log's fsync per group commit (the router's default: FULL)")
    ap.add_argument("--parts", default="client,streams,rps,memory", help="comma-separated: which parts to run")
    ap.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "gateway.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if "rps" in parts and shutil.which("wrk") is None:
        sys.exit("wrk is needed for the requests-per-second part (apt-get install wrk)")

    work = Path(tempfile.mkdtemp(prefix="xroute-bench-gw-"))
    standin_proc: subprocess.Popen[bytes] | None = None
    gateways: list[Gateway] = []
    load0 = os.getloadavg()
    out: dict[str, Any] = {"benchmark": "gateway", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "cores": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in load0],
                           "python": platform.python_version(),
                           "note": "one machine shared with other work: the load generator, the stand-in, the gateway "
                                   "and its decision-log writer share its cores",
                           "goals": {"added_ttft_p50_ms": 1.0, "added_ttft_p99_ms": 5.0, "rps_one_worker": 1000},
                           "litellm_published": LITELLM}
    try:
        sport = free_port()
        standin = f"http://127.0.0.1:{sport}"
        with open(work / "standin.log", "ab") as log:
            standin_proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_standin", "--port", str(sport),
                                             "--max-num-seqs", "8192"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        br._wait_ready(f"{standin}/v1/models", standin_proc)
        key_file = work / "keys.json"
        key = subprocess.run([sys.executable, "-m", "router.control.keys", "add", "--tenant", "bench", "--keys-file",
                              str(key_file)], capture_output=True, text=True, check=True,
                             cwd=REPO).stdout.strip().splitlines()[-1]
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        plain = {"Content-Type": "application/json"}
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Summarize the following paragraph in one sentence. " * 8}]
        stream_body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": args.stream_tokens,
                                  "stream": True}).encode()

        if "client" in parts:  # ------------------------------------------------------------------
            _admin(standin, ttft_s=0.0, tpot_s=0.0, output_tokens=16)
            out["client"] = asyncio.run(_client_cost(f"{standin}/v1/chat/completions", 1000))
            print(f"client: {out['client']}", flush=True)

        if "memory" in parts:  # (first, on a gateway of its own: its heap not grown by the other parts)
            gw = Gateway(work, standin, key_file, "gateway-memory")
            gateways.append(gw)
            _admin(standin, ttft_s=0.0, tpot_s=0.0, output_tokens=4)
            asyncio.run(_streams(f"{gw.url}/v1/chat/completions", auth, stream_body, 8, 2.0, 0.0))  # warm up
            _admin(standin, ttft_s=0.0, tpot_s=1.0, output_tokens=600)
            time.sleep(1.0)
            idle, idle_w = _rss_kib(gw.proc.pid), _rss_kib(gw.writer) if gw.writer else 0
            held = asyncio.run(_hold(f"{gw.url}/v1/chat/completions", auth, stream_body, args.hold, gw.proc.pid,
                                     gw.writer))
            out["memory"] = {"idle_rss_kib": idle, "idle_writer_rss_kib": idle_w, **held,
                             "kib_per_stream": round((held["rss_kib"] - idle) / max(held["opened"], 1), 1)}
            print(f"memory: {out['memory']}", flush=True)
            gw.stop()
            gateways.remove(gw)

        gw = Gateway(work, standin, key_file, "gateway", {"XROUTE_ROUTER_DB_SYNCHRONOUS": args.db_synchronous})
        gateways.append(gw)
        out["db_synchronous"] = args.db_synchronous

        if "streams" in parts:  # -----------------------------------------------------------------
            _admin(standin, ttft_s=args.ttft_ms / 1000, tpot_s=args.tpot_ms / 1000, output_tokens=args.stream_tokens)
            asyncio.run(_streams(f"{gw.url}/v1/chat/completions", auth, stream_body, 20, 3.0))  # warm both paths
            asyncio.run(_streams(f"{standin}/v1/chat/completions", plain, stream_body, 20, 3.0))
            rounds = []
            for r in range(args.rounds):
                order = [("direct", standin, plain), ("gateway", gw.url, auth)]
                if r % 2:
                    order.reverse()
                row: dict[str, Any] = {}
                for name, base, headers in order:
                    cpu0 = gw.cpu_s()
                    row[name] = asyncio.run(_streams(f"{base}/v1/chat/completions", headers, stream_body, args.streams,
                                                     args.stream_s))
                    row[name]["gateway_cpu_s"] = round(gw.cpu_s() - cpu0, 2)
                    print(f"streams round {r} {name}: {row[name]}", flush=True)
                for q in ("p50_ms", "p99_ms"):
                    row[f"added_ttft_{q}"] = round(row["gateway"]["ttft"].get(q, float("nan"))
                                                   - row["direct"]["ttft"].get(q, float("nan")), 3)
                rounds.append(row)
            out["streams"] = {"rounds": rounds, "concurrent": args.streams, "tokens": args.stream_tokens,
                              "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
                              **{f"added_ttft_{q}": float(np.median([x[f"added_ttft_{q}"] for x in rounds]))
                                 for q in ("p50_ms", "p99_ms")}}

        if "rps" in parts:  # ---------------------------------------------------------------------
            _admin(standin, ttft_s=0.0, tpot_s=0.0, output_tokens=16)
            req = {"model": MODEL, "messages": messages, "max_tokens": 16}
            lua_d, lua_g = _wrk_lua(work / "direct.lua", req, None), _wrk_lua(work / "gw.lua", req, key)
            # the same server's POST /v1/route, a decision alone (what the gateway adds to it: forwarding, measuring)
            lua_r = _wrk_lua(work / "route.lua", {"origin": ORIGIN, "input_tokens": 120, "max_output_tokens": 16,
                                                  "ttft_ms": 2000, "tpot_ms": 100, "model": MODEL}, key)
            br.run_wrk(f"{gw.url}/v1/chat/completions", lua_g, 3, args.rps_conns)  # warm-up
            rps_rounds = []
            for r in range(args.rounds):
                pairs = [("direct", f"{standin}/v1/chat/completions", lua_d, None),
                         ("gateway", f"{gw.url}/v1/chat/completions", lua_g, gw.proc.pid),
                         ("route", f"{gw.url}/v1/route", lua_r, gw.proc.pid)]
                if r % 2:
                    pairs.reverse()
                row = {name: br.run_wrk(url, lua, args.rps_s, args.rps_conns, pid) for name, url, lua, pid in pairs}
                print(f"rps round {r}: {row}", flush=True)
                rps_rounds.append(row)
            plain_body = json.dumps(req).encode()
            out["not_streamed_overhead"] = asyncio.run(_streams(f"{gw.url}/v1/chat/completions", auth, plain_body,
                                                                args.rps_conns, args.rps_s))
            print(f"not streamed, the gateway's own overhead: {out['not_streamed_overhead']}", flush=True)
            out["not_streamed"] = {"rounds": rps_rounds, "connections": args.rps_conns,
                                   "gateway_rps": float(np.median([x["gateway"]["rps"] for x in rps_rounds])),
                                   "direct_rps": float(np.median([x["direct"]["rps"] for x in rps_rounds]))}
    finally:
        for g in gateways:
            g.stop()
        if standin_proc is not None:
            standin_proc.terminate()
            standin_proc.wait(timeout=20)
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))
    shutil.rmtree(work, ignore_errors=True)


def table(out: dict[str, Any]) -> str:
    lines = [f"Gateway overhead ({out['cores']} cores, shared; load average {out['load_average_at_start'][0]} at "
             f"start, {out['load_average_at_end'][0]} at the end)", "",
             "| measure | direct to the stand-in | through the gateway | added | goal |", "|---|---:|---:|---:|---|"]
    s = out.get("streams")
    if s:
        med = {f"{w}{q}": float(np.median([x[w]["ttft"].get(q, np.nan) for x in s["rounds"]]))
               for w in ("direct", "gateway") for q in ("p50_ms", "p99_ms")}
        for q, goal in (("p50_ms", "<= 1 ms"), ("p99_ms", "<= 5 ms")):
            lines.append(f"| TTFT {q[:3]}, {s['concurrent']} concurrent streams (ms) | {med['direct' + q]:.2f} | "
                         f"{med['gateway' + q]:.2f} | {s['added_ttft_' + q]:+.2f} | {goal} |")
        ov = [x["gateway"].get("gateway_overhead", {}) for x in s["rounds"]]
        if all(ov):
            for q in ("p50_ms", "p99_ms"):
                lines.append(f"| the gateway's own overhead before the first token, {q[:3]} (ms; x-xroute-overhead-ms) | "
                             f"| {float(np.median([o[q] for o in ov])):.2f} | | |")
        last = s["rounds"][-1]
        lines.append(f"| streams completed per second | {last['direct']['streams_per_s']} | "
                     f"{last['gateway']['streams_per_s']} | | |")
        lines.append(f"| gateway CPU seconds per streaming phase ({s['rounds'][-1]['gateway'].get('gateway_cpu_s')} s "
                     "used) | | | | |")
    r = out.get("not_streamed")
    if r:
        med = {f"{w}{k}": float(np.median([x[w][k] for x in r["rounds"]]))
               for w in ("direct", "gateway") for k in ("rps", "p50_ms", "p99_ms")}
        cpu = float(np.median([x["gateway"].get("server_cpu_us_per_req", np.nan) for x in r["rounds"]]))
        lines.append(f"| not streamed, req/s ({r['connections']} connections, one worker) | {med['directrps']:.0f} | "
                     f"{med['gatewayrps']:.0f} | | >= 1,000/s |")
        for k in ("p50_ms", "p99_ms"):
            lines.append(f"| not streamed, latency {k[:3]} (ms) | {med['direct' + k]:.2f} | {med['gateway' + k]:.2f} | "
                         f"{med['gateway' + k] - med['direct' + k]:+.2f} | |")
        lines.append(f"| gateway event-loop CPU per request, not streamed (us) | | {cpu:.0f} | | |")
        if all("route" in x for x in r["rounds"]):
            rcpu = float(np.median([x["route"].get("server_cpu_us_per_req", np.nan) for x in r["rounds"]]))
            rrps = float(np.median([x["route"]["rps"] for x in r["rounds"]]))
            lines.append(f"| the same server's POST /v1/route (a decision alone): req/s, CPU per request (us) | | "
                         f"{rrps:.0f}, {rcpu:.0f} | {cpu - rcpu:+.0f} us | |")
        nso = out.get("not_streamed_overhead", {}).get("gateway_overhead")
        if nso:
            for q in ("p50_ms", "p99_ms"):
                lines.append(f"| the gateway's own overhead, not streamed, {q[:3]} (ms; {r['connections']} clients) | | "
                             f"{nso[q]:.2f} | | |")
    m = out.get("memory")
    if m:
        lines.append(f"| memory per open stream (KiB; {m['opened']} held, {m['errors']} refused) | | "
                     f"{m['kib_per_stream']} | | |")
    c = out.get("client")
    if c:
        lines.append(f"| HTTP client CPU per request: httpx {c['httpx_cpu_us']:.0f} us, aiohttp {c['aiohttp_cpu_us']:.0f} "
                     "us | | | | |")
    lines += ["", "LiteLLM's published proxy figures:", ""]
    for x in out["litellm_published"]:
        figs = ", ".join(f"{k} {v}" for k, v in x.items() if k != "source")
        lines.append(f"- {figs} -- {x['source']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
