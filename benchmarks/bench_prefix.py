"""Prefix affinity's cost: the shared index's lookup in process and on Redis over loopback, and the
environment's step rate with prefix caching on vs off.

* **In process** (``router.state.embedded.EmbeddedState``): an index filled with 20,000 earlier decisions
  (conversations of 64-block prompts over a catalog of 100 offerings, the shipped bundle's cycled),
  then, per lookup, a 64-block prompt whose prefix some pools hold: the state's lookup plus the
  engine's conversion to the environment's arrays (``RoutingEngine._live_prefix``) -- what the
  affinity adds before a decision -- and the admission with the record after it; and a whole
  decision (the service's ``decide`` with the embedded state) with and without the request's
  prefix hashes and session, side by side. Target: the lookup <= 15 us p99.
* **Redis** (``router.state.redis.RedisState``, a real redis-server on loopback, no persistence):
  the same index; the lookup awaited one at a time (one round trip), and the admission with the
  prefix's record (one script) next to the admission alone. Target: the lookup <= 1 ms p99.
* **The environment** (``xroute/CloudRoute-v0`` on the Mooncake bundle, 3,993 requests, 93
  offerings): steps per second with its ``prefix_hashes`` and without them (the same bundle, the
  column dropped), rounds interleaved, CPU time of this process, the action the first valid
  offering (the environment's own cost, as ``bench_env``) and greedy's. Goal: ratio >= 0.7.

    .venv/bin/python benchmarks/bench_prefix.py [--lookups 20000 --redis-lookups 5000 --rounds 7]

Prints a table and writes ``benchmarks/results/prefix.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from envs.cloud_route import CloudRouteEnv  # noqa: E402
from router.core.settings import load_settings  # noqa: E402
from router.decision.engine import RoutingEngine  # noqa: E402
from router.state.base import Admission, PrefixSend  # noqa: E402
from router.state.embedded import EmbeddedState  # noqa: E402
from tests.state_support import decide  # noqa: E402
from xroute.bundle import load_bundle  # noqa: E402
from xroute.catalog_tools import resize_catalog  # noqa: E402
from xroute.schema.access import Principal  # noqa: E402
from xroute.schema.decision import RouteRequest  # noqa: E402

BLOCKS = 64
OFFERINGS = 100
HISTORY = 20_000
WHO = Principal("bench", "tenant", "k")


def _pct(ts: np.ndarray) -> dict[str, float]:
    ts = ts[min(200, ts.size // 10):] * 1e6
    return {"p50_us": round(float(np.percentile(ts, 50)), 2), "p99_us": round(float(np.percentile(ts, 99)), 2),
            "mean_us": round(float(ts.mean()), 2), "calls": int(ts.size)}


def _prompts(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Conversations: a prompt extends an earlier one (a next turn) or shares its first half (a
    shared document), else starts anew; 64 blocks each."""
    out: list[np.ndarray] = []
    for _ in range(n):
        u = rng.random()
        if out and u < 0.6:
            base = out[int(rng.integers(max(0, len(out) - 2000), len(out)))]
            keep = int(rng.integers(BLOCKS // 2, BLOCKS))
            new = np.concatenate([base[:keep], rng.integers(-2**62, 2**62, BLOCKS - keep)])
        else:
            new = rng.integers(-2**62, 2**62, BLOCKS)
        out.append(new.astype(np.int64))
    return out


def _engine(tmp: Path) -> RoutingEngine:
    """An engine on the shipped bundle's catalog cycled to 100 offerings (written to ``tmp``)."""
    b = resize_catalog(load_bundle(), OFFERINGS)
    for name in ("offerings", "prices", "availability", "rtt", "workload"):
        df = getattr(b, name)
        if df is not None:
            df.to_csv(tmp / f"{name}.csv", index=False)
    return RoutingEngine(load_settings(tmp / "router.yaml", telemetry=tmp, model_uri="", max_telemetry_age_s=1e9,
                                       replay_speed=1.0, tenants={WHO.tenant: {}}))  # unknown tenants fail closed


def _send(engine: RoutingEngine, hashes: np.ndarray, pool: str, session: str | None) -> PrefixSend:
    return PrefixSend(hashes, session, 600.0, {pool: (4096, 0.0, 0.0)})


def in_process(n: int, tmp: Path) -> dict[str, Any]:
    (tmp / "router.yaml").write_text("{}\n")
    engine = _engine(tmp)
    rng = np.random.default_rng(0)
    state = EmbeddedState()
    pools = engine.pool_keys[engine.env.default_model]
    prompts = _prompts(rng, HISTORY + n)
    for i in range(HISTORY):
        pool = pools[int(rng.integers(len(pools)))]
        state.core.admit(Admission(f"h{i}", [(pool, 10**9)], 3600.0,
                                   prefix=_send(engine, prompts[i], pool, f"bench:s{i % 3000}")))
    m = engine.env.default_model
    look, conv, rec = np.empty(n), np.empty(n), np.empty(n)
    matched = 0
    for i in range(n):
        h = prompts[HISTORY + i]
        sess = f"bench:s{i % 3000}"
        t0 = time.perf_counter()
        aff = state.core.lookup(h, sess, 600.0)
        t1 = time.perf_counter()
        engine._live_prefix(m, aff)
        t2 = time.perf_counter()
        pool = pools[i % len(pools)]
        state.core.admit(Admission(f"q{i}", [(pool, 10**9)], 3600.0, prefix=_send(engine, h, pool, sess)))
        t3 = time.perf_counter()
        look[i], conv[i], rec[i] = t1 - t0, t2 - t0, t3 - t2
        matched += bool(aff.runs)
    # whole decisions, with and without the prefix, interleaved (the same request otherwise)
    base = {"origin": engine.origins[0], "input_tokens": BLOCKS * engine.block_tokens, "max_output_tokens": 256,
            "ttft_ms": 30000, "tpot_ms": 200}
    with_p, without = np.empty(n // 4), np.empty(n // 4)
    wall = engine.source.start_wall
    for i in range(n // 4):
        h = prompts[HISTORY + i].tolist()
        for arr, body in ((with_p, {**base, "prefix_hashes": h, "session_id": f"s{i % 3000}"}), (without, base)):
            req = RouteRequest.model_validate(body)
            t0 = time.perf_counter()
            decide(engine, req, WHO, f"d{i}{len(body)}", wall + i * 1e-3, state)
            arr[i] = time.perf_counter() - t0
    return {"lookup": _pct(look), "lookup_and_conversion": _pct(conv), "admit_recording": _pct(rec),
            "lookups_with_a_match": round(matched / n, 3), "decision_with_prefix": _pct(with_p),
            "decision_without": _pct(without), "offerings": engine.n, "blocks_per_prompt": BLOCKS,
            "index_decisions_before": HISTORY}


async def on_redis(url: str, n: int) -> dict[str, Any]:
    from router.state.redis import RedisState

    state = RedisState(url, prefix=f"bench-prefix-{time.time_ns()}")
    try:
        rng = np.random.default_rng(0)
        pools = [f"llama-2-7b|o{k}" for k in range(OFFERINGS)]
        prompts = _prompts(rng, HISTORY // 4 + n)
        for i in range(HISTORY // 4):  # the index filled through the pipeline, 50 at a time
            await state.admit(Admission(f"h{i}", [(pools[int(rng.integers(len(pools)))], 10**9)], 3600.0, prefix=PrefixSend(
                prompts[i], f"s{i % 3000}", 600.0, {p: (4096, 0.0, 0.0) for p in pools})))
        look, both, alone = np.empty(n), np.empty(n), np.empty(n)
        matched = 0
        for i in range(n):
            h = prompts[HISTORY // 4 + i]
            t0 = time.perf_counter()
            aff = await state.lookup(h, f"s{i % 3000}", 600.0)
            t1 = time.perf_counter()
            pool = pools[i % len(pools)]
            await state.admit(Admission(f"q{i}", [(pool, 10**9)], 3600.0,
                                        prefix=PrefixSend(h, f"s{i % 3000}", 600.0, {pool: (4096, 0.0, 0.0)})))
            t2 = time.perf_counter()
            await state.admit(Admission(f"r{i}", [(pool, 10**9)], 3600.0))
            t3 = time.perf_counter()
            look[i], both[i], alone[i] = t1 - t0, t2 - t1, t3 - t2
            matched += bool(aff.runs)
        return {"lookup": _pct(look), "admit_recording": _pct(both), "admit_alone": _pct(alone),
                "lookups_with_a_match": round(matched / n, 3)}
    finally:
        await state.close()


def env_rates(rounds: int) -> dict[str, Any]:
    from models.baselines import Greedy

    b = load_bundle("mooncake")
    off = dataclasses.replace(b, workload=b.workload.drop(columns=["prefix_hashes"]))
    envs = {"on": CloudRouteEnv(b, episode_requests=None), "off": CloudRouteEnv(off, episode_requests=None)}

    def measure(env: CloudRouteEnv, policy: str) -> float:
        obs, info = env.reset(seed=0)
        g = Greedy()
        g.reset(env, 0)
        t0 = time.process_time()
        k = 0
        done = False
        while not done:
            a = int(np.argmax(info["action_mask"])) if policy == "first-valid" else g.act(obs, info)
            obs, _, _, done, info = env.step(a)
            k += 1
        return k / (time.process_time() - t0)

    out: dict[str, Any] = {}
    for policy in ("first-valid", "greedy"):
        for e in envs.values():
            measure(e, policy)  # warm-up (compiles)
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(rounds):
            for name, e in envs.items():
                rates[name].append(measure(e, policy))
        on, offr = statistics.median(rates["on"]), statistics.median(rates["off"])
        out[policy] = {"on_steps_per_s": round(on), "off_steps_per_s": round(offr), "ratio": round(on / offr, 3),
                       "on_rounds": [round(x) for x in rates["on"]], "off_rounds": [round(x) for x in rates["off"]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lookups", type=int, default=20000)
    ap.add_argument("--redis-lookups", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "prefix.json")
    a = ap.parse_args()
    res: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (nproc), Python "
                                      f"{platform.python_version()}", "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        res["in_process"] = in_process(a.lookups, Path(tmp))
    from tests.servers import RedisServer, ServerError

    try:
        server = RedisServer().start()
    except ServerError as e:
        sys.exit(f"bench_prefix: error: {e}")
    try:
        res["redis"] = asyncio.run(on_redis(server.url, a.redis_lookups))
    finally:
        server.close()
    res["env"] = env_rates(a.rounds)
    res["load_average_at_end"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    ip, rd, ev = res["in_process"], res["redis"], res["env"]
    print(f"machine: {res['machine']}; load average {res['load_average_at_start'][0]:.2f} at start, "
          f"{res['load_average_at_end'][0]:.2f} at end\n")
    print(f"| measure ({ip['offerings']} offerings, {BLOCKS} blocks a prompt) | p50 us | p99 us | target |")
    print("|---|---:|---:|---|")
    for label, d, target in (
            ("in process: lookup", ip["lookup"], ""),
            ("in process: lookup + conversion to the env's arrays", ip["lookup_and_conversion"], "<= 15 us p99"),
            ("in process: admission with the record", ip["admit_recording"], ""),
            ("in process: decision with prefix + session", ip["decision_with_prefix"], ""),
            ("in process: decision without", ip["decision_without"], ""),
            ("Redis loopback: lookup (one round trip)", rd["lookup"], "<= 1 ms p99"),
            ("Redis loopback: admission with the record (one script)", rd["admit_recording"], ""),
            ("Redis loopback: admission alone", rd["admit_alone"], "")):
        print(f"| {label} | {d['p50_us']} | {d['p99_us']} | {target} |")
    print(f"\nlookups that matched some pool: in process {ip['lookups_with_a_match']:.0%}, Redis "
          f"{rd['lookups_with_a_match']:.0%}\n")
    print("| env (mooncake bundle), policy | steps/s caching on | off | ratio (goal >= 0.7) |\n|---|---:|---:|---:|")
    for policy, d in ev.items():
        print(f"| {policy} | {d['on_steps_per_s']} | {d['off_steps_per_s']} | {d['ratio']} |")
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
