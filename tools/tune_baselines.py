#!/usr/bin/env python
"""Tune the knobs of the cache-aware and session-sticky baselines on training windows only.

    .venv/bin/python tools/tune_baselines.py [--bundles mooncake default] [--sample 4000] [--seeds 1]

Each candidate setting is run on the *train* window (``configs/train.yaml``'s split) of each bundle
at each load (x1, x4), and scored by its mean reward averaged over those scenarios -- the windows
``xroute evaluate --window test`` reports on, and the gate judges on, are never seen. Prints every
setting's score and the best, as the ``cache_aware`` / ``session_sticky`` blocks of
``configs/evaluate.yaml`` (where the chosen values are kept, with the command that chose them).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from envs.cloud_route import CloudRouteEnv  # noqa: E402
from models.baselines import CacheAware, Policy, SessionSticky  # noqa: E402
from models.config import load_train_config  # noqa: E402
from models.evaluate import run_policy, sample_rows  # noqa: E402
from models.scenarios import resolve_bundle, split_bundle  # noqa: E402
from xroute.config import EvaluateConfig, config_path, load_config  # noqa: E402

PREFIX_WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0)
LOAD_WEIGHTS = (0.0, 0.3, 1.0, 3.0)
COST_WEIGHTS = (0.5, 1.0, 2.0)
MARGINS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundles", nargs="+", default=["mooncake", "default"])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--sample", type=int, default=4000, help="requests of each train window (evenly spaced blocks)")
    ap.add_argument("--seeds", type=int, default=1)
    a = ap.parse_args(argv)
    cfg = load_config(EvaluateConfig, config_path("evaluate.yaml"))
    split = load_train_config(None).split
    envs = []
    for name in a.bundles:
        sp = split_bundle(resolve_bundle(name, "--bundles"), split)
        b = sp.bundles["train"]
        if a.sample and len(b.workload) > a.sample:
            b = b.select(sample_rows(len(b.workload), a.sample))
        for r in a.rates:
            env_cfg = cfg.env.model_copy(update={"rate_scale": r, "episode_requests": None})
            envs.append((f"{name} x{r:g}", CloudRouteEnv(b, env_cfg, history=sp.history("train"))))

    def score(make: object) -> float:
        vals = []
        for _, env in envs:
            for s in range(a.seeds):
                pol: Policy = make()  # type: ignore[operator]
                vals.append(run_policy(env, pol, cfg.seed + s).metrics["mean_reward"])
        return float(np.mean(vals))

    t0 = time.time()
    rows = []
    for wp, wl, wc in itertools.product(PREFIX_WEIGHTS, LOAD_WEIGHTS, COST_WEIGHTS):
        rows.append((score(lambda wp=wp, wl=wl, wc=wc: CacheAware(wp, wl, wc)), wp, wl, wc))
        print(f"cache-aware prefix={wp:g} load={wl:g} cost={wc:g}: {rows[-1][0]:.6f}", flush=True)
    best_ca = max(rows)
    sticky = []
    for mg in MARGINS:
        sticky.append((score(lambda mg=mg: SessionSticky(mg)), mg))
        print(f"session-sticky margin={mg:g}: {sticky[-1][0]:.6f}", flush=True)
    best_st = max(sticky)
    print(f"\nscenarios (train windows): {', '.join(n for n, _ in envs)}; {a.seeds} seed(s); "
          f"{time.time() - t0:.0f} s\n")
    print("cache_aware:")
    print(f"  prefix_weight: {best_ca[1]:g}\n  load_weight: {best_ca[2]:g}\n  cost_weight: {best_ca[3]:g}"
          f"   # mean train reward {best_ca[0]:.6f}")
    print(f"session_sticky:\n  margin: {best_st[1]:g}   # mean train reward {best_st[0]:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
