"""Routing policies' cost, side by side in one run (``docs/policies.md``, "Cost").

1. **Mask and bias per decision** at 100 offerings and 50 policies that all apply to every request
   (the worst case: attribute-only denies and allows, numeric denies and allows, prefer policies
   with and without limits): per decision, the cached context lookup plus the compiled apply
   (``CompiledPolicies.context`` + ``apply``: numeric constraints against the current price, RTT
   and headroom), timed on the environment's own arrays request after request; the same with the
   context compiled afresh (a cache miss: a new tenant/model/class/origin); the whole set's
   compilation; and the environment's steps per second with the policies and without (the same
   actions in both, each step timed).
2. **The route's throughput with the 50 policies on vs off** (:data:`VARIANTS`), side by side: in
   process (``RoutingEngine.decide``, greedy fallback, the variants' engines interleaved in rounds;
   decisions/s and p50/p99), and over HTTP (``xroute serve``, one worker each, ``wrk`` on loopback,
   ``--rounds`` rounds in rotated order, every run paired with a trivial endpoint as
   ``bench_router.py`` does) -- the ratio on/off per round, median and range, and the ratio of
   the server's CPU time per request (off / on: less moved by other load on a shared machine).

To add a variant (e.g. quotas on, or policies and quotas on): add an entry to :data:`VARIANTS` --
its router settings (``XROUTE_ROUTER_*`` for ``xroute serve``; the same keys for the in-process
engine) and whether it installs the policy set -- and every part measures it with the others.

Usage::

    .venv/bin/python benchmarks/bench_policies.py                    # ~6 min (HTTP needs wrk)
    .venv/bin/python benchmarks/bench_policies.py --duration 5 --rounds 2   # quicker

Writes ``benchmarks/results/policies.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchmarks.bench_router as br  # noqa: E402

#: label -> (router settings as XROUTE_ROUTER_* environment, whether the 50 policies are installed)
VARIANTS: dict[str, tuple[dict[str, str], bool]] = {
    "policies_off": ({}, False),
    "policies_on": ({}, True),
}
N_POLICIES = 50
TENANT = "bench"


def policy_set(catalog: list[Any], n: int = N_POLICIES, seed: int = 0) -> Any:
    """``n`` policies over ``catalog``'s values, every one applying to every request (no target:
    the worst case), none excluding everything."""
    from xroute.schema.policy_ir import PolicySet

    rng = np.random.default_rng(seed)
    regions = sorted({o.location for o in catalog})
    accs = sorted({o.accelerator for o in catalog})
    its = sorted({o.instance_type for o in catalog})
    policies: list[dict[str, Any]] = []
    for k in range(n):
        kind = k % 10
        c: dict[str, Any]
        if kind < 4:  # attribute-only denies, each a narrow slice
            c = {"regions": [str(rng.choice(regions))], "accelerators": [str(rng.choice(accs))]}
            p = {"effect": "deny", "constraints": c}
        elif kind < 6:  # numeric denies: a price ceiling on a slice, a minimum headroom for spot
            c = ({"accelerators": [str(rng.choice(accs))], "max_usd_per_hour": float(rng.uniform(2, 10))} if kind == 4
                 else {"pricing_modes": ["spot"], "regions": [str(rng.choice(regions))], "min_headroom": 0.1})
            p = {"effect": "deny", "constraints": c}
        elif kind < 8:  # allows: broad (the union admits most), one of them numeric
            c = ({"instance_types": [f"{str(rng.choice(its))[:2]}*", "*-x1"]} if kind == 6
                 else {"max_rtt_ms": 400.0})
            p = {"effect": "allow", "constraints": c}
        else:  # prefers, with and without limits
            c = ({"regions": [str(rng.choice(regions))]} if kind == 8
                 else {"pricing_modes": ["on_demand"], "min_headroom": 0.5})
            p = {"effect": "prefer", "weight": float(rng.choice([0.01, 0.02, 0.05])), "constraints": c}
        policies.append({"name": f"p{k:02d}", "priority": int(rng.integers(0, 3)), **p})
    return PolicySet.model_validate({"policies": policies})


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 2), "p99_us": round(float(np.percentile(a, 99)), 2),
            "mean_us": round(float(a.mean()), 2), "n": int(a.size)}


def bench_masks(bundle: Path, n: int) -> dict[str, Any]:
    """Part 1 (module docstring)."""
    from envs import policies as pol
    from envs.cloud_route import CloudRouteEnv
    from envs.kernels import BUSY
    from xroute.config import EnvConfig

    env = CloudRouteEnv(str(bundle), EnvConfig(episode_requests=None))
    ps = policy_set(env.catalog)
    t = []
    for _ in range(20):
        t0 = time.perf_counter()
        compiled = pol.CompiledPolicies(ps, env.catalog)
        t.append(time.perf_counter() - t0)
    compile_set = _pct(t)
    pol.warm_up()
    out = compiled.outcome_buffers()
    obs, info = env.reset(seed=0)
    cached: list[float] = []
    miss: list[float] = []
    pre = np.ones(env.n, dtype=bool)
    excluded = []
    for i in range(n):
        key = (TENANT, env.model_names[env.r_m], "", env.origins[int(env.req_origin[env._pos])])
        mask = env.c_mask.copy()
        busy, slots = env.C[BUSY], env.slots[env.r_m]
        t0 = time.perf_counter()
        ctx = compiled.context(*key)
        compiled.apply(ctx, pre, env.usd_h, env.c_rtt, busy, slots, mask, out)
        t1 = time.perf_counter()
        cached.append(t1 - t0)
        excluded.append(out.excluded)
        if i % 10 == 0:  # a context never seen: compiled, then applied
            t0 = time.perf_counter()
            ctx = compiled.context(f"other-{i}", *key[1:])
            compiled.apply(ctx, pre, env.usd_h, env.c_rtt, busy, slots, mask, out)
            miss.append(time.perf_counter() - t0)
        valid = np.flatnonzero(env.c_mask)
        obs, _, _, done, info = env.step(int(valid[i % valid.size]) if valid.size else 0)
        if done:
            obs, info = env.reset(seed=i)
    ctx = compiled.context(*key)
    skip = min(1000, n // 10)
    # steps per second with the policies in the mask and without, on the same trajectory: both
    # environments take the same actions (valid under the policies, so valid in both while their
    # pools agree), each step timed on its own
    envs = {"off": CloudRouteEnv(str(bundle), EnvConfig(episode_requests=None)),
            "on": CloudRouteEnv(str(bundle), EnvConfig(episode_requests=None, policies=ps))}
    for e in envs.values():
        e.reset(seed=0)
    spent: dict[str, list[float]] = {"off": [], "on": []}
    k = 0
    while k < 5000:
        valid = np.flatnonzero(envs["on"].c_mask)
        a = int(valid[k % valid.size]) if valid.size else 0
        done = False
        for label, e in envs.items():
            t0 = time.perf_counter()
            _, _, _, done, _ = e.step(a)
            spent[label].append(time.perf_counter() - t0)
        k += 1
        if done or not valid.size:
            for e in envs.values():
                e.reset(seed=k)
    steps = {label: _pct(t) for label, t in spent.items()}
    return {"offerings": env.n, "policies": len(ps.policies), "checked_per_decision": int(ctx.dyn_kind.size),
            "excluded_per_decision_mean": round(float(np.mean(excluded)), 2),
            "cached_context_and_apply": _pct(cached[skip:]), "uncached_context_compile_and_apply": _pct(miss),
            "compile_whole_set": compile_set, "env_step": steps,
            "env_step_p50_ratio_off_on": round(steps["off"]["p50_us"] / steps["on"]["p50_us"], 3)}


def _engine(bundle: Path, settings_env: dict[str, str], install: bool, work: Path) -> Any:
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine

    cfg = work / "router.yaml"
    cfg.write_text("{}\n")
    old = {k: os.environ.get(k) for k in settings_env}
    os.environ.update(settings_env)
    try:
        eng = RoutingEngine(load_settings(cfg, telemetry=bundle, model_uri="", max_telemetry_age_s=1e9,
                                          tenants={TENANT: {}}))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if install:
        eng.install_policies(eng.compile_policies(policy_set(eng.catalog).model_copy(update={"version": 1})))
    return eng


def bench_engine(bundle: Path, n: int, rounds: int, work: Path) -> dict[str, Any]:
    """Part 2, in process: ``RoutingEngine.decide`` per variant, interleaved in rounds."""
    from tests.state_support import decide
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    engines = {v: _engine(bundle, s, on, work) for v, (s, on) in VARIANTS.items()}
    who = Principal(TENANT, "tenant", "k")
    origins = next(iter(engines.values())).origins
    reqs = [RouteRequest(origin=origins[i % len(origins)], input_tokens=200 + (i * 37) % 1800,
                         max_output_tokens=10 + (i * 13) % 60, ttft_ms=2000.0, tpot_ms=100.0) for i in range(256)]
    per: dict[str, list[dict[str, float]]] = {v: [] for v in engines}
    clock = {v: 0 for v in engines}
    for r in range(rounds):
        for v, eng in engines.items():
            wall0 = eng.source.start_wall  # type: ignore[attr-defined]
            times = []
            for i in range(n):
                wall = wall0 + 0.02 * clock[v]
                clock[v] += 1
                t0 = time.perf_counter()
                decide(eng, reqs[i % 256], who, f"d_{r}_{i}", wall)
                times.append(time.perf_counter() - t0)
            skip = min(1000, n // 10) if r == 0 else 0
            p = _pct(times[skip:])
            p["decisions_per_s"] = round(1e6 / p["mean_us"], 1)
            per[v].append(p)
    out: dict[str, Any] = {}
    for v, runs in per.items():
        out[v] = {k: round(float(np.median([x[k] for x in runs])), 2) for k in ("p50_us", "p99_us", "decisions_per_s")}
    base = per["policies_off"]
    for v, runs in per.items():
        ratios = [a["decisions_per_s"] / b["decisions_per_s"] for a, b in zip(runs, base)]
        out[v]["ratio_to_off"] = {"median": round(float(np.median(ratios)), 3), "min": round(min(ratios), 3),
                                  "max": round(max(ratios), 3)}
        # the same at the median decision (robust to the preemptions a shared machine adds to the mean)
        out[v]["p50_ratio_off_to_this"] = round(float(np.median([b["p50_us"] / a["p50_us"] for a, b in zip(runs, base)])),
                                                3)
    return out


def bench_http(work: Path, bundle: Path, seconds: float, rounds: int) -> dict[str, Any]:
    """Part 2 over HTTP: ``xroute serve`` per variant (the policies through ``policy_files``)."""
    if shutil.which("wrk") is None:
        return {"skipped": "wrk not found: sudo apt-get install wrk"}
    import yaml

    from envs.cloud_route import CloudRouteEnv
    from router.control.keys import add_key
    from xroute.config import EnvConfig

    key = add_key(work / "keys.json", TENANT)
    catalog = CloudRouteEnv(str(bundle), EnvConfig(episode_requests=1)).catalog
    pol_dir = work / "policies"
    pol_dir.mkdir(exist_ok=True)
    (pol_dir / "bench.yaml").write_text(yaml.safe_dump(policy_set(catalog).model_dump(mode="json", exclude_none=True,
                                                                                           exclude={"version"})))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref = br._Server.simple(work, "trivial", "auto", env)
    servers: dict[str, br._Server] = {}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        ref.warm_up()
        for v, (settings_env, on) in VARIANTS.items():
            e = {**env, **settings_env}
            if on:
                e["XROUTE_ROUTER_POLICY_FILES"] = json.dumps([str(pol_dir)])
            servers[v] = br._Server.route(work, bundle, "", key, e, f"pol-{v}")
            servers[v].warm_up()
        order = list(VARIANTS)
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
    out: dict[str, Any] = {v: br._median_of(rs) for v, rs in runs.items()}
    for v, rs in runs.items():
        ratios = [a["vs_trivial"] / b["vs_trivial"] for a, b in zip(rs, runs["policies_off"])]
        cpu = [b["server_cpu_us_per_req"] / a["server_cpu_us_per_req"] for a, b in zip(rs, runs["policies_off"])
               if a.get("server_cpu_us_per_req") and b.get("server_cpu_us_per_req")]
        out[v]["throughput_ratio_to_off"] = {"median": round(float(np.median(ratios)), 3),
                                             "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
        if cpu:
            out[v]["cpu_per_request_ratio_off_to_this"] = round(float(np.median(cpu)), 3)
        out[v]["non_2xx"] = sum(x["non_2xx"] for x in rs)
    return out


def table(res: dict[str, Any]) -> str:
    m = res["masks"]
    lines = [f"machine: {res['machine']} (shared with other jobs: see the load averages)", "",
             f"mask + bias per decision, {m['offerings']} offerings, {m['policies']} policies "
             f"({m['checked_per_decision']} checked per decision, {m['excluded_per_decision_mean']} offerings "
             "excluded on average):", "",
             "| what | p50 µs | p99 µs |", "|---|---:|---:|"]
    for k in ("cached_context_and_apply", "uncached_context_compile_and_apply", "compile_whole_set"):
        lines.append(f"| {k.replace('_', ' ')} | {m[k]['p50_us']} | {m[k]['p99_us']} |")
    lines += ["", f"environment step, same actions: p50 off {m['env_step']['off']['p50_us']} µs, on "
              f"{m['env_step']['on']['p50_us']} µs (throughput ratio at the median {m['env_step_p50_ratio_off_on']})",
              "", "route, in process (RoutingEngine.decide, greedy):", "",
              "| variant | decisions/s | p50 µs | p99 µs | throughput ratio to off (median, range) "
              "| at the median decision |", "|---|---:|---:|---:|---|---:|"]
    for v, x in res["engine"].items():
        r = x["ratio_to_off"]
        lines.append(f"| {v} | {x['decisions_per_s']} | {x['p50_us']} | {x['p99_us']} | {r['median']} "
                     f"({r['min']}-{r['max']}) | {x['p50_ratio_off_to_this']} |")
    http = res["http"]
    if "skipped" in http:
        lines += ["", f"HTTP: {http['skipped']}"]
    else:
        lines += ["", "POST /v1/route over HTTP (wrk -c10, one worker; each run paired with a trivial endpoint):", "",
                  "| variant | req/s | p50 ms | p99 ms | CPU µs/req | throughput ratio to off (median, range) "
                  "| CPU/req ratio off/this (median) |", "|---|---:|---:|---:|---:|---|---:|"]
        for v, x in http.items():
            r = x["throughput_ratio_to_off"]
            lines.append(f"| {v} | {x['rps']} | {x['p50_ms']} | {x['p99_ms']} | {x.get('server_cpu_us_per_req')} "
                         f"| {r['median']} ({r['min']}-{r['max']}) | {x.get('cpu_per_request_ratio_off_to_this')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=20000, help="decisions per in-process measurement (>= 100)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (in process) and rotated rounds (HTTP)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of wrk per HTTP run")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "policies.json")
    a = ap.parse_args()
    br.at_least(ap, ("--decisions", a.decisions, 100), ("--rounds", a.rounds, 1), ("--duration", a.duration, 1))
    work = Path(tempfile.mkdtemp(prefix="bench-policies-"))
    try:
        b100 = br.make_bundle(work / "bundle100", 100)
        res: dict[str, Any] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "load_average_at_start": os.getloadavg(),
            "masks": bench_masks(b100, a.decisions),
            "engine": bench_engine(b100, a.decisions // 2, a.rounds, work),
            "http": bench_http(work, b100, a.duration, a.rounds),
            "load_average_at_end": os.getloadavg(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
