"""Access control's cost per request, side by side in one run (``docs/policies.md``, "Access
control").

1. **The check alone**, at 100 offerings: what ``router.http.deps`` and ``RoutingEngine.rank`` do per
   request -- the caller's compiled permissions (cached per key), ``can_infer``, and the offering
   mask of the request's model (cached per key and model) -- for a built-in tenant key (every region:
   no mask), a key whose role grants 10 region wildcards (a mask), and an admin check
   (``allows("admin:read:policies")``); and the same with nothing cached (a new access version: the
   permissions compiled and the mask computed over the 100 offerings).
2. **The decision with and without a mask**: ``RoutingEngine.decide`` (greedy fallback) for the
   built-in tenant key and for the 10-grant role's key, interleaved in rounds; decisions/s, p50/p99
   and the ratio.

Usage::

    .venv/bin/python benchmarks/bench_rbac.py                 # ~1 min
    .venv/bin/python benchmarks/bench_rbac.py --decisions 4000 --rounds 2

Writes ``benchmarks/results/rbac.json`` and prints a table.
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

TENANT = "bench"


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"p50_us": round(float(np.percentile(a, 50)), 3), "p99_us": round(float(np.percentile(a, 99)), 3),
            "mean_us": round(float(a.mean()), 3), "n": int(a.size)}


def _engine(bundle: Path, work: Path) -> Any:
    from router.core.settings import load_settings
    from router.decision.engine import RoutingEngine

    cfg = work / "router.yaml"
    cfg.write_text("{}\n")
    return RoutingEngine(load_settings(cfg, telemetry=bundle, model_uri="", max_telemetry_age_s=1e9,
                                       tenants={TENANT: {}}))


def _roles(eng: Any) -> dict[str, Any]:
    from xroute.schema.access import Role

    regions = sorted({r["region"] for r in eng.refs})
    # 10 grants: the first half of the catalog's regions (any model; written as wildcards over the
    # location, '*:<region>'), the rest for models no request names (checked, matching nothing)
    half = regions[: max(1, len(regions) // 2)][:10]
    grants = [f"model:inference:*:*:{reg}" for reg in half]
    grants += [f"model:inference:other-{i}-*:*" for i in range(10 - len(grants))]
    return {"regional": Role(grants=grants)}


def bench_check(eng: Any, n: int) -> dict[str, Any]:
    from router.decision.access import AccessControl
    from xroute.schema.access import Principal

    roles = _roles(eng)
    model = eng.models[0]
    tenant_key = Principal(TENANT, "tenant", "k1")
    regional = Principal(TENANT, "regional", "k2")
    admin = Principal(TENANT, "admin", "k3")
    out: dict[str, Any] = {}
    acc = AccessControl(roles, {}, eng.refs, 1)
    mask = acc.inference_mask(regional, model)
    out["regional_offerings_allowed"] = int(mask.sum()) if mask is not None else eng.n
    for label, who in (("tenant_key_cached", tenant_key), ("regional_role_cached", regional)):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            p = acc.permissions(who)
            if p.can_infer:
                acc.inference_mask(who, model)
            times.append(time.perf_counter() - t0)
        out[label] = _pct(times)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        acc.permissions(admin).allows("admin:read:policies")
        times.append(time.perf_counter() - t0)
    out["admin_check_cached"] = _pct(times)
    times = []
    for _ in range(max(n // 20, 50)):
        fresh = AccessControl(roles, {}, eng.refs, 2)
        t0 = time.perf_counter()
        fresh.permissions(regional)
        fresh.inference_mask(regional, model)
        times.append(time.perf_counter() - t0)
    out["regional_role_uncached"] = _pct(times)
    return out


def bench_decide(eng: Any, n: int, rounds: int) -> dict[str, Any]:
    from router.decision.access import AccessControl
    from tests.state_support import decide
    from xroute.schema.access import Principal
    from xroute.schema.decision import RouteRequest

    eng.install_access(AccessControl(_roles(eng), {}, eng.refs, 1))
    who = {"tenant_key": Principal(TENANT, "tenant", "k1"), "regional_role": Principal(TENANT, "regional", "k2")}
    origins = eng.origins
    reqs = [RouteRequest(origin=origins[i % len(origins)], input_tokens=200 + (i * 37) % 1800,
                         max_output_tokens=10 + (i * 13) % 60, ttft_ms=2000.0, tpot_ms=100.0) for i in range(256)]
    per: dict[str, list[dict[str, float]]] = {v: [] for v in who}
    wall0 = eng.source.start_wall
    clock = 0
    for r in range(rounds):
        for v, w in who.items():
            times = []
            for i in range(n):
                wall = wall0 + 0.02 * clock
                clock += 1
                t0 = time.perf_counter()
                decide(eng, reqs[i % 256], w, f"d_{v}_{r}_{i}", wall)
                times.append(time.perf_counter() - t0)
            skip = min(500, n // 10) if r == 0 else 0
            p = _pct(times[skip:])
            p["decisions_per_s"] = round(1e6 / p["mean_us"], 1)
            per[v].append(p)
    out: dict[str, Any] = {v: {k: round(float(np.median([x[k] for x in runs])), 2)
                               for k in ("p50_us", "p99_us", "decisions_per_s")} for v, runs in per.items()}
    ratios = [a["decisions_per_s"] / b["decisions_per_s"] for a, b in zip(per["regional_role"], per["tenant_key"])]
    out["regional_to_tenant_key"] = {"median": round(float(np.median(ratios)), 3), "min": round(min(ratios), 3),
                                     "max": round(max(ratios), 3)}
    return out


def table(res: dict[str, Any]) -> str:
    c = res["check"]
    lines = [f"machine: {res['machine']}; load average at start {res['load_average_at_start'][0]:.2f}", "",
             f"the check alone (100 offerings; the regional role allows {c['regional_offerings_allowed']}):",
             f"{'':28s}{'p50 us':>10s}{'p99 us':>10s}"]
    for k in ("tenant_key_cached", "regional_role_cached", "admin_check_cached", "regional_role_uncached"):
        lines.append(f"{k:28s}{c[k]['p50_us']:>10.3f}{c[k]['p99_us']:>10.3f}")
    d = res["decide"]
    lines += ["", "RoutingEngine.decide (greedy), median of rounds:", f"{'':28s}{'p50 us':>10s}{'p99 us':>10s}"
              f"{'dec/s':>10s}"]
    for k in ("tenant_key", "regional_role"):
        lines.append(f"{k:28s}{d[k]['p50_us']:>10.2f}{d[k]['p99_us']:>10.2f}{d[k]['decisions_per_s']:>10.1f}")
    r = d["regional_to_tenant_key"]
    lines.append(f"ratio regional/tenant key: {r['median']} (min {r['min']}, max {r['max']})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=10000, help="decisions per in-process measurement (>= 100)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "rbac.json")
    a = ap.parse_args()
    br.at_least(ap, ("--decisions", a.decisions, 100), ("--rounds", a.rounds, 1))
    work = Path(tempfile.mkdtemp(prefix="bench-rbac-"))
    try:
        eng = _engine(br.make_bundle(work / "bundle100", 100), work)
        res: dict[str, Any] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "load_average_at_start": os.getloadavg(),
            "check": bench_check(eng, a.decisions),
            "decide": bench_decide(eng, a.decisions // 2, a.rounds),
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
