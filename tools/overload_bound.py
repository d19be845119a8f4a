"""What the TPOT allows in the overload scenario (``configs/overload.yaml``; ``docs/results.md``,
"Overload", "The last two targets"): how far the critical band and the quiet tenant can get when the
rest of their misses are gone, and what holding a pool's batch low enough for them costs.

The simulated world's time per output token is its pool's ``tpot(k) x f``: ``k`` the pool's requests
in flight per replica when the request is placed (at most the slots per replica less one), ``f`` the
request's service noise (lognormal, mean 1, log-sd ``sigma``; ``envs.cloud_route``). So a request
whose TPOT SLO is under ``tpot(k)`` misses it at batch ``k`` with ``P(f > slo / tpot(k))``
(``envs.kernels.violation_probability``, the router's own P(miss)), whatever the admission does. Per
batch ``k`` of each pool that can meet the tight TPOT unloaded, this prints that probability, the
attainment it bounds for the critical band and the quiet tenant (``1 - share of their requests with
that SLO x P(miss)``: every other miss gone), and the pool's steady completion rate while it is held
there (a request is placed only while ``k`` or fewer per replica run: ``k x replicas + 1`` busy, each
``mean output x tpot + mean prompt / prefill rate`` long), plus the other pools full -- an upper bound
of the goodput while that batch is held. Reads the scenario and
its serving model only (the realized mean lengths, for the rates: an analysis, not a decision).

    .venv/bin/python tools/overload_bound.py [--config configs/overload.yaml]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pandas as pd

from envs.cloud_route import CloudRouteEnv
from envs.kernels import violation_probability
from models.config import TrainConfig
from models.scenarios import eval_env_config, overload_scenario
from xroute import admission_rules as ar
from xroute.config import EvaluateConfig, config_path, load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/overload.yaml")
    ap.add_argument("--tenant", default="quiet", help="the quiet tenant's name")
    args = ap.parse_args()
    ecfg = load_config(EvaluateConfig, config_path("configs/evaluate.yaml"))
    tcfg = load_config(TrainConfig, config_path("configs/train.yaml"))
    sc, meta = overload_scenario(config_path(args.config), tcfg.split)
    whole = {k: v for k, v in (sc.env or {}).items() if k not in ("tiers", "policies")}  # (the pools whole)
    env = CloudRouteEnv(sc.bundle, eval_env_config(ecfg, sc.rate, whole), history=sc.history)
    env.reset(seed=0)
    m = 0  # (the scenario serves one model)
    tight = float(env.req_tpot.min())
    is_tight = env.req_tpot == tight
    tenant = np.asarray(env.req_tenant).astype(str)
    share = {"critical": float(is_tight[env.req_band == ar.band_index("critical")].mean()),
             args.tenant: float(is_tight[tenant == args.tenant].mean())}
    print(f"{len(env.req_tpot)} requests over {float(env.arrival.max() - env.arrival.min()):.0f} s, "
          f"nproc {os.cpu_count()}; the tightest TPOT SLO {tight:g} ms, asked by {is_tight.mean():.1%} of them "
          f"(TTFT SLO {sorted(set(env.req_ttft[is_tight].tolist()))} ms): "
          + ", ".join(f"{k} {v:.1%}" for k, v in share.items()))
    mean_out, mean_in = float(env.req_out.mean()), float(env.req_in.mean())

    def rate(a: int, k: float) -> float:
        """Pool ``a``'s completions per second with ``k`` requests per replica busy."""
        tp = env.tpot_s[m, a] + env.tpot_growth_s[m, a] * min(k, env.conc_m1[m, a])
        return float(k * env.replicas[m, a] / (mean_out * tp + mean_in * env.inv_prefill[m, a]))

    pools = range(env.n)
    full = {a: rate(a, float(env.conc[m, a])) for a in pools}
    for a in pools:
        o = env.catalog[a].offering_id
        print(f"pool {o}: {env.replicas[m, a]:g} replicas x {env.conc[m, a]:g} slots, tpot(k) = "
              f"{1000 * env.tpot_s[m, a]:.1f} + {1000 * env.tpot_growth_s[m, a]:.2f} k ms, sigma "
              f"{env.sigma[m, a]:g}; full: {full[a]:.2f} req/s")
    rows = []
    for a in pools:
        if 1000.0 * env.tpot_s[m, a] > tight:
            continue  # (misses the tight TPOT even unloaded: no batch of it helps)
        others = sum(full[b] for b in pools if b != a)
        for k in range(int(env.conc[m, a])):
            tp = 1000.0 * (env.tpot_s[m, a] + env.tpot_growth_s[m, a] * k)
            p = float(violation_probability(tight / tp, float(env.sigma[m, a])))
            row = {"pool": env.catalog[a].offering_id, "k": k, "in_flight": k * float(env.replicas[m, a]),
                   "tpot_ms": round(tp, 2), "p_miss": round(p, 4),
                   **{f"bound[{n}]": round(1.0 - s * p, 4) for n, s in share.items()},
                   "goodput_bound_rps": round(rate(a, k + 1.0 / float(env.replicas[m, a])) + others, 2)}
            rows.append(row)
        drain = (full[a] and (float(env.conc[m, a]) - 3.0) * float(env.replicas[m, a]) / full[a])
        print(f"  draining it from full to 3 per replica takes {drain:.1f} s at its full completion rate")
    print("| pool | k per replica | in flight | tpot(k) ms | P(tight TPOT miss) | critical at most | "
          f"{args.tenant} at most | goodput at most, req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pool']} | {r['k']} | {r['in_flight']:g} | {r['tpot_ms']} | {100 * r['p_miss']:.1f} % | "
              f"{100 * r['bound[critical]']:.1f} % | {100 * r[f'bound[{args.tenant}]']:.1f} % | "
              f"{r['goodput_bound_rps']} |")
    crit = {k for k, t in meta["config"]["tenants"].items() if t["band"] == "critical"}
    sizing = [tier_size(env, a, tight, share["critical"], sc.history, sc.rate, crit)
              for a in pools if 1000.0 * env.tpot_s[m, a] <= tight]
    for z in sizing:
        print(f"tier sizing rule for {z['pool']}: max_batch = the largest b whose fullest placement (b-1 running) "
              f"misses the {tight:g} ms TPOT with P <= {z['p_budget']:.1%} (half the critical band's 1 % budget over "
              f"its tight share) -> {z['max_batch']}; the tier serves the critical band's tight requests; replicas = "
              f"their p95 arrival rate over 10 s windows in the history (the windows before the test one, x"
              f"{sc.rate:g}: {z['p95_rps']:.2f} req/s; mean {z['mean_rps']:.2f}: they come in bursts) / one replica's "
              f"completions at that batch ({z['per_replica_rps']:.2f} req/s, their mean lengths there), rounded up "
              f"-> {z['replicas']}")
    print(json.dumps({"share_tight": share, "rows": rows, "tier_sizing": sizing}))


def tier_size(env: CloudRouteEnv, a: int, tight: float, crit_share: float, history: pd.DataFrame | None,
              rate: float, critical: set[str]) -> dict:
    """The tight tier of pool ``a`` the rule gives (printed above; ``configs/overload.yaml`` uses it):
    sized on the history, never on the window it is judged on."""
    m = 0
    p_budget = 0.005 / max(crit_share, 1e-9)
    b = 1
    for k in range(int(env.conc[m, a])):
        tp = 1000.0 * (env.tpot_s[m, a] + env.tpot_growth_s[m, a] * k)
        if float(violation_probability(tight / tp, float(env.sigma[m, a]))) <= p_budget:
            b = k + 1
    if history is None or not len(history):
        raise SystemExit("the scenario has no history to size the tier on")
    h = history[(history["tpot_ms"] <= tight) & history["tenant"].isin(critical)]
    t = pd.to_datetime(history["ts"])
    ts = ((pd.to_datetime(h["ts"]) - t.min()).dt.total_seconds() / rate).to_numpy()
    span = float((t.max() - t.min()).total_seconds() / rate)
    counts, _ = np.histogram(ts, bins=np.arange(0.0, span + 10.0, 10.0))
    p95 = float(np.quantile(counts, 0.95)) / 10.0
    out, inp = float(h["output_tokens"].mean()), float(h["input_tokens"].mean())
    per = b / (out * (env.tpot_s[m, a] + env.tpot_growth_s[m, a] * (b - 1)) + inp * env.inv_prefill[m, a])
    return {"pool": env.catalog[a].offering_id, "p_budget": p_budget, "max_batch": b, "requests": len(h),
            "mean_rps": len(h) / span, "p95_rps": p95, "per_replica_rps": float(per),
            "replicas": int(np.ceil(p95 / per))}

if __name__ == "__main__":
    main()
