"""``xroute train``: DQN trials in parallel with Ray Tune, tracked and registered in MLflow.

Flow (``run_training``), each step in the module that does it:

1. The scenarios (``models.scenarios``): the train windows of several real bundles, each also with
   a perturbed catalog, at several loads; the validation windows of the selection bundles; the gate's
   test windows of every bundle at two loads.
2. Every baseline on the first selection window (the table each trial is compared to).
3. The warm start's rollout labels, collected once over the training mix
   (``models.warmstart_labels``, with ``models.warmstart``).
4. Ray Tune runs one function trial per grid point (seeds x gamma x learning rate), at most
   ``ray.max_concurrent_trials`` at a time, one torch thread each (``models.tune``). A trial
   (``models.trial.run_trial``, which runs without Ray too) fits the warm start (keeping the epoch
   that decides best on the selection windows), trains ``MaskedDQN`` on the training mix, validates
   the numpy export on the selection windows every ``eval_every`` steps and keeps its best
   checkpoint, and its warm start alone for the ablation. It logs params, learning curves, tables
   and plots to its own MLflow run (``models.tracking``).
5. The best trial (by its worst Δ to greedy over the selection windows) and its warm start alone are run beside every
   baseline on the gate scenarios, paired by seed (``models.gate``); the verdict -- does it beat the
   best baseline on data no selection saw, and lose nowhere? -- is recorded with the model, logged
   as an MLflow pyfunc model, registered and given the alias ``challenger`` (``models.tracking``,
   ``models.registry``). ``xroute promote`` moves ``champion`` only when the gate passed.

Ray is only touched in ``models.tune`` and ``models.warmstart_labels``; torch and
stable-baselines3 only when a trial or a labelling task runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models import evaluate as ev
from models import gate, loader, registry, tracking, tune
from models.baselines import BASELINES
from models.config import TrainConfig
from models.scenarios import build_scenarios, eval_env_config, train_env_config
from models.trial import TrialContext, run_trial
from models.warmstart_labels import cached_warm_start


@dataclass
class TrainSummary:
    best: dict[str, Any]
    trials: list[dict[str, Any]]
    scenarios: dict[str, Any]
    gate: list[Any]  # models.gate.ScenarioResult
    decision: Any  # models.gate.GateDecision for the challenger
    ablation: Any  # models.gate.GateDecision for its warm start alone
    model_uri: str | None
    registered_version: str | None
    tracking_uri: str
    wall_s: float


def grid(cfg: TrainConfig) -> list[dict[str, Any]]:
    gammas = cfg.search.gamma or [cfg.dqn.gamma]
    lrs = cfg.search.learning_rate or [cfg.dqn.learning_rate]
    return [{"seed": s, "gamma": g, "learning_rate": lr} for s in cfg.search.seeds for g in gammas for lr in lrs]


#: the gate's rows: the trained router (warm start, then DQN steps when total_timesteps > 0) and its ablation
CHALLENGER, WARM_ONLY = "learned (challenger)", "warm start only"


def run_training(cfg: TrainConfig, telemetry: str | Path | None = None, ray_address: str | None = None,
                 echo: Callable[[str], None] = print, use_ray: bool = True) -> TrainSummary:
    """The whole ``xroute train`` (see the module docstring)."""
    t_start = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if use_ray:
        tune.check_ray_address(ray_address)
    run_dir = cfg.run_path()
    run_dir.mkdir(parents=True, exist_ok=True)
    sc = build_scenarios(cfg, telemetry)
    eval_cfg = cfg.evaluate_settings()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    echo(f"training: {', '.join(s.label for s in sc.train)} (train windows), loads x{', x'.join(map(str, cfg.rate_scales))}")
    windows = {x.label.rsplit(" ", 1)[0]: len(x.bundle.workload) for x in sc.selection}
    echo(f"selection: {', '.join(x.label for x in sc.selection)} (validation windows, "
         f"{', '.join(f'{k} {n}' for k, n in windows.items())} requests)")
    echo(f"gate: {', '.join(s.label for s in sc.gate)} (test windows, {cfg.data.gate_seeds} seeds)")
    bundle_hash = ",".join(f"{k}={v}" for k, v in sc.bundle_hashes.items())

    uri = loader.tracking_uri(run_dir, cfg.mlflow.tracking_uri)
    exp_id = registry.setup(uri, cfg.mlflow.experiment, run_dir)
    echo(f"MLflow: {uri} (experiment '{cfg.mlflow.experiment}')")

    sel = sc.selection[0]
    echo(f"baselines on the first selection window ({sel.label}) ...")
    sel_cfg = eval_cfg.model_copy(update={"env": eval_env_config(eval_cfg, sel.rate)})
    baselines = [b for b in BASELINES if b != "oracle"]  # (the hindsight oracle is no baseline to beat)
    baseline_runs = ev.evaluate(sel.bundle, baselines, sel_cfg, show_progress=False,
                                seeds=cfg.data.gate_seeds, history=sel.history)
    bb = tracking.best_baseline(baseline_runs)
    echo(f"best baseline on {sel.label}: {bb.name} (mean reward {bb.metrics['mean_reward']:.5f})")

    with tracking.training_run(exp_id, f"train-{stamp}", bundle_hash) as parent:
        tracking.log_training_inputs(cfg, sc, bundle_hash, baseline_runs)
        out_dir = run_dir / "trials" / stamp
        ctx = TrialContext(cfg=cfg, eval_cfg=eval_cfg, train=sc.train, selection=sc.selection, bundle_hash=bundle_hash,
                           baseline_runs=baseline_runs, max_offerings=sc.max_offerings, tracking_uri=uri,
                           experiment_id=exp_id, parent_run_id=parent.info.run_id, out_dir=str(out_dir),
                           extra_params={"selection": sel.label})
        points = grid(cfg)
        env_cfg = train_env_config(cfg, eval_cfg, sc.max_offerings)
        with tune.ray_session(cfg, ray_address, use_ray):
            ctx.warm_data = cached_warm_start(cfg, env_cfg, sc.train, bundle_hash,
                                              run_dir / "warm_start" if cfg.warm_start.cache else None, use_ray, echo)
            echo(f"{len(points)} trials x {cfg.total_timesteps} DQN steps, "
                 f"at most {cfg.ray.max_concurrent_trials} at a time")
            if use_ray:
                trials = tune.tune_trials(cfg, ctx, points, run_dir / "tune", f"train-{stamp}", echo)
            else:
                trials = [run_trial(p, ctx) for p in points]
        best = max(trials, key=lambda t: t["val_criterion"])
        echo(f"best trial: {best['trial']} (worst Δ reward vs greedy over the selection loads {best['val_criterion']:+.5f}"
             f" with margin {best['margin']:g}, the best-scoring {best.get('margin_best', best['margin']):g};"
             f" {best['val_criterion_no_margin']:+.5f} without; checkpoint at step "
             f"{best['best_step']}; its warm start alone {best['warm_start_val_criterion']:+.5f})")

        # the gate: test windows no selection saw, paired by seed
        routers = {CHALLENGER: best["router_dir"], WARM_ONLY: best["warm_dir"]}
        gate_runs = gate.evaluate_gate(sc.gate, routers, eval_cfg, cfg.data.gate_seeds,
                                       baselines, echo)
        margins = (cfg.data.gate_margin, cfg.data.gate_margin_rel)
        decision = gate.decide(gate_runs, CHALLENGER, *margins)
        ablation = gate.decide(gate_runs, WARM_ONLY, *margins)
        families = gate.families_markdown(gate_runs, [CHALLENGER, WARM_ONLY], *margins)
        echo("gate by family (paired Δ mean reward to greedy, 95 % CI; non-inferior where above minus the larger of "
             f"{margins[0]:g} and {margins[1]:g} x greedy's |reward|, in each scenario):\n{families}")
        echo(f"gate: {'PASSED' if decision.passed else 'refused'}: {decision.reason}")
        tracking.log_gate(gate.markdown(gate_runs, [CHALLENGER, WARM_ONLY]), gate_runs, decision, ablation, best,
                          out_dir, cfg.data.gate_seeds, families)

    model_uri, version = tracking.log_and_register(cfg, best, bb, decision, ablation, sc.selection[0], uri, echo)
    return TrainSummary(best=best, trials=trials, scenarios=sc.describe(), gate=gate_runs, decision=decision,
                        ablation=ablation, model_uri=model_uri, registered_version=version, tracking_uri=uri,
                        wall_s=time.perf_counter() - t_start)
