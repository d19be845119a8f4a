"""Tune the budget-pacing baseline's gain on the training windows (``EvaluateConfig.pacing_gain``).

    .venv/bin/python tools/tune_pacing.py                    # configs/train.yaml's data and splits
    .venv/bin/python tools/tune_pacing.py --seeds 2 --gains 0.3,1,3,10

The windows are the train windows of ``data.train`` (configs/train.yaml), each at the loads of
``rate_scales``, under the evaluate config's env (its tenant budgets): the gate and the reports
judge on other windows. Prints one row per gain and the gain to put in configs/evaluate.yaml.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import load_train_config
from models.evaluate import tune_pacing_gain
from models.scenarios import resolve_bundle, split_bundle
from xroute.config import EvaluateConfig, config_path, load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-config", default=None)
    ap.add_argument("--evaluate-config", default="evaluate.yaml")
    ap.add_argument("--gains", default="0,0.3,1,2,3,5,10")
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    tcfg = load_train_config(args.train_config)
    cfg = load_config(EvaluateConfig, config_path(args.evaluate_config))
    windows = []
    for ref in tcfg.data.train:
        splits = split_bundle(resolve_bundle(ref, "data.train"), tcfg.split)
        windows.append((splits.bundles["train"], splits.history("train")))
    gains = [float(x) for x in args.gains.split(",")]
    best, rows = tune_pacing_gain(windows, cfg, gains, list(tcfg.rate_scales), args.seeds)
    print(f"train windows of {', '.join(map(str, tcfg.data.train))} at x{', x'.join(f'{r:g}' for r in tcfg.rate_scales)}, "
          f"{args.seeds} seed(s)")
    print("| gain | mean reward | refused (budget) | refused (rate) |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['gain']:g} | {r['mean_reward']:.5f} | {r['refused_budget']} | {r['refused_rate_limit']} |")
    print(f"pacing_gain: {best:g}")


if __name__ == "__main__":
    main()
