"""The overload scenario (``configs/overload.yaml``; ``docs/results.md``, "Overload"), with the
admission on and off (today's world) and the scenario's serving tiers on and off (``--tiers``: the
tiers and the policies saying who may use them, or neither) side by side, same seeds: per band and
per tenant SLO attainment, goodput, shed and queued counts, queue wait p95, Jain's index.

    .venv/bin/python tools/overload.py [--config overload.yaml] [--seeds 3] [--policies greedy ...]
        [--rates 1 2 4]   (the load; default the config's rate_scale)
        [--tiers both|on|off] [--admission both|on|off]
        [--share noisy=0.05 ...]   (a tenant at a lower share: its other requests dropped; the
                                    isolation check, the noisy tenant at the quiet one's share)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from models import evaluate as ev
from models.config import TrainConfig
from models.scenarios import eval_env_config, overload_scenario
from xroute.config import EvaluateConfig, config_path, load_config
from xroute.errors import ConfigError

KEYS = ("slo_attainment[band=critical]", "slo_attainment[band=standard]", "slo_attainment[band=sheddable]",
        "slo_attainment[tenant=quiet]", "slo_attainment[tenant=noisy]", "goodput_rps", "shed[band=critical]",
        "shed[band=standard]", "shed[band=sheddable]", "queued", "queue_wait_p95_ms[band=critical]",
        "queue_wait_p95_ms[band=standard]", "jain[band=standard]", "sla_attainment", "failed_requests")


def _which(flag: str) -> tuple[bool, ...]:
    return {"both": (False, True), "on": (True,), "off": (False,)}[flag]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/overload.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=["greedy", "least-loaded", "lowest-latency", "cheapest"])
    ap.add_argument("--rates", type=float, nargs="+", default=None)
    ap.add_argument("--tiers", choices=("both", "on", "off"), default="both",
                    help="with the config's tiers and policies, without both, or each (default)")
    ap.add_argument("--admission", choices=("both", "on", "off"), default="both")
    ap.add_argument("--share", nargs="+", default=[], metavar="TENANT=SHARE",
                    help="run with these tenants at a lower share of the stream (their other requests dropped)")
    ap.add_argument("--out", default="reports/overload.json")
    args = ap.parse_args()
    shares = {}
    for item in args.share:
        name, _, value = item.partition("=")
        try:
            shares[name] = float(value)
        except ValueError:
            raise SystemExit(f"overload: --share {item!r}: expected TENANT=SHARE with a number") from None
    ecfg = load_config(EvaluateConfig, config_path("configs/evaluate.yaml"))
    tcfg = load_config(TrainConfig, config_path("configs/train.yaml"))
    try:
        sc, meta = overload_scenario(config_path(args.config), tcfg.split, shares)
    except ConfigError as e:
        raise SystemExit(f"overload: {e}") from None
    rows = []
    for rate in args.rates or [sc.rate]:
        for tiered, on in [(t, a) for t in _which(args.tiers) for a in _which(args.admission)]:
            env = {**(sc.env or {})}
            env["admission"] = {**env["admission"], "enabled": on}
            if not tiered:
                env.pop("tiers", None)
                env.pop("policies", None)
            cfg = ecfg.model_copy(update={"env": eval_env_config(ecfg, rate, env)})
            for r in ev.evaluate(sc.bundle, args.policies, cfg, show_progress=False, seeds=args.seeds,
                                 history=sc.history):
                row = {"policy": r.name, "rate": rate, "shares": shares, "tiers": tiered and bool(env.get("tiers")), "admission": on}
                for k in KEYS:
                    if k in r.metrics:
                        lo, hi = r.ci.get(k, (float("nan"), float("nan")))
                        row[k] = [round(r.metrics[k], 4), round(lo, 4), round(hi, 4)]
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"scenario": sc.label, "requests": len(sc.bundle.workload), "seeds": args.seeds, "nproc": os.cpu_count(),
           "command": "tools/overload.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v), **meta,
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
