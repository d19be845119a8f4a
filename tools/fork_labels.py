#!/usr/bin/env python
"""The warm start's labels with the environment's budget book shared by every fork (the bug of
issue 26) and copied (``models.warmstart.fork``), on the same states of the training mix.

    .venv/bin/python tools/fork_labels.py --states 150

Prints, for each way, the share of non-greedy candidates labelled above greedy, the labels' spread
and minimum, and the share below -1 among the top-k candidates and among the random ones
(``docs/results.md``, "The label outliers were a forking bug").
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from envs.cloud_route import CloudRouteEnv
from models import warmstart as ws
from models.config import load_train_config
from models.scenarios import ScenarioMix, build_scenarios, train_env_config

_FIXED = ws.fork


def shared_book_fork(env: Any) -> Any:
    """``fork`` as it was before the fix: the fork spends into the environment's own budget book."""
    sim = _FIXED(env)
    sim.budget = env.budget
    return sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="train config (default configs/train.yaml)")
    ap.add_argument("--states", type=int, default=150)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()
    cfg = load_train_config(args.config)
    c = cfg.warm_start
    sc = build_scenarios(cfg)
    env_cfg = train_env_config(cfg, cfg.evaluate_settings(), sc.max_offerings)
    fixed = _FIXED
    try:
        for name, f in (("book shared (before)", shared_book_fork), ("book copied (fixed)", fixed)):
            ws.fork = f
            mix = ScenarioMix([CloudRouteEnv(s.bundle, env_cfg, history=s.history) for s in sc.train], cfg.rate_scales,
                              args.seed)
            t0 = time.perf_counter()
            d = ws.collect(mix.pick, args.states, c.horizon, c.top_k, c.random_actions, c.stride, c.behaviour_epsilon,
                           np.random.default_rng(args.seed))
            col = np.where(d.weight > 0, d.advantage, np.nan)[:, 1:]
            adv = col[np.isfinite(col)]
            top, rnd = col[:, : c.top_k - 1], col[:, c.top_k - 1:]

            def share(a: np.ndarray) -> float:
                return 100 * float((a < -1).sum() / max(np.isfinite(a).sum(), 1))

            print(f"{name}: {args.states} states in {time.perf_counter() - t0:.0f} s; candidates beating greedy "
                  f"{100 * (adv > 1e-9).mean():.1f} %; advantage sd {adv.std():.2f}, min {adv.min():+.2f}; "
                  f"below -1: top {c.top_k} {share(top):.1f} %, random {share(rnd):.1f} %")
    finally:
        ws.fork = fixed


if __name__ == "__main__":
    main()
