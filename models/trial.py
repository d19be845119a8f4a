"""One training trial (``run_trial``): a DQN agent trained on the training mix and selected on the
selection windows, without Ray (``models.tune`` runs one per grid point in Ray Tune).

The trial fits the warm start (keeping the epoch that decides best on the selection windows),
trains ``MaskedDQN`` on the training mix, validates the numpy export on the selection windows every
``eval_every`` steps and keeps its best checkpoint, its best margin, and its warm start alone for
the ablation; it logs to its own MLflow run (``models.tracking``). torch and stable-baselines3 are
imported when a trial runs, not with this module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from envs.cloud_route import CloudRouteEnv
from models import tracking
from models.baselines import make_baseline
from models.config import TrainConfig
from models.policy import RewardPrior, save_router
from models.scenarios import Scenario, ScenarioMix, eval_env_config, train_env_config
from xroute.config import EvaluateConfig

Report = Callable[[dict[str, Any], "str | None"], None]


@dataclass
class TrialContext:
    """What every trial needs; shipped once to the Ray object store (``tune.with_parameters``)."""

    cfg: TrainConfig
    eval_cfg: EvaluateConfig
    train: list[Scenario]
    selection: list[Scenario]
    bundle_hash: str
    baseline_runs: list[Any]  # models.evaluate.PolicyResult on the selection window
    warm_data: Any = None  # models.warmstart.RolloutData, shared by all trials
    max_offerings: int = 0  # observation padding: the largest catalog of every scenario
    tracking_uri: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None
    out_dir: str = ""
    extra_params: dict[str, Any] = field(default_factory=dict)
    #: in-process only (the ablation runner): fitted warm starts shared by trials (WarmStartCallback)
    warm_cache: dict[Any, Any] | None = None
    #: also export the last checkpoint (``router/last``), beside the best and the warm start alone
    save_last: bool = False


def trial_name(params: dict[str, Any]) -> str:
    return f"s{params['seed']}-g{params['gamma']:g}-lr{params['learning_rate']:g}"


def run_trial(params: dict[str, Any], ctx: TrialContext, report: Report | None = None) -> dict[str, Any]:
    """Train one DQN agent; returns its best validation metrics and the export directory.

    ``params``: ``seed``, ``gamma``, ``learning_rate``. ``report(metrics, checkpoint_dir)`` is
    called with progress (``checkpoint_dir`` only on the last call). Works without Ray."""
    import torch as th

    th.set_num_threads(1)
    from models.callbacks import (
        ProgressCallback,
        Selection,
        ValidationCallback,
        WarmStartCallback,
        best_margin,
        calibrate_margin,
        score_gap,
    )
    from models.qnet import FlatObservation, MaskedDQN, SharedScorerDQNPolicy, SiblingPlay

    cfg, seed = ctx.cfg, int(params["seed"])
    gamma, lr = float(params["gamma"]), float(params["learning_rate"])
    name = trial_name(params)
    out = Path(ctx.out_dir or ".") / name
    out.mkdir(parents=True, exist_ok=True)
    env_cfg = train_env_config(cfg, ctx.eval_cfg, ctx.max_offerings)
    mix = ScenarioMix([CloudRouteEnv(sc.bundle, env_cfg, history=sc.history) for sc in ctx.train], cfg.rate_scales,
                      seed)
    d = cfg.dqn
    env: Any = FlatObservation(mix) if d.n_steps > 1 else mix  # (SB3's n-step returns need a non-Dict space)
    siblings = None
    if d.siblings > 0:  # (on the Dict observation: the config refuses n_steps > 1 with them; MaskedDQN sets gamma)
        env = siblings = SiblingPlay(mix, d.siblings, d.sibling_every, d.sibling_horizon,
                                         continuation=d.sibling_continuation, extra=d.sibling_extra)
    demo = ctx.warm_data if d.demo_weight > 0 and ctx.warm_data is not None and len(ctx.warm_data) else None
    model = MaskedDQN(
        SharedScorerDQNPolicy, env, learning_rate=lr, gamma=gamma, buffer_size=d.buffer_size,
        learning_starts=d.learning_starts, batch_size=d.batch_size, tau=d.tau, train_freq=d.train_freq,
        gradient_steps=d.gradient_steps, target_update_interval=d.target_update_interval,
        exploration_fraction=d.exploration_fraction, exploration_initial_eps=d.exploration_initial_eps,
        exploration_final_eps=d.exploration_final_eps, max_grad_norm=d.max_grad_norm, seed=seed, device="cpu",
        n_steps=d.n_steps, loss=d.loss, reward_scale=d.reward_scale, exploration=d.exploration,
        exploration_top_k=d.exploration_top_k, demo=demo, demo_weight=d.demo_weight,
        demo_batch_size=d.demo_batch_size, warmup=d.warmup, siblings=siblings, sibling_weight=d.sibling_weight,
        sibling_batch_size=d.sibling_batch_size, sibling_buffer=d.sibling_buffer, td_weight=d.td_weight,
        sibling_gamma=d.sibling_gamma, sibling_bootstrap=d.sibling_bootstrap,
        policy_kwargs={"net_arch": list(cfg.net.hidden), "context_dim": cfg.net.context_dim,
                       "prior": asdict(RewardPrior.from_env_config(env_cfg)) if cfg.net.reward_prior else None,
                       "prior_scale": d.reward_scale},
    )
    mlrun = tracking.start_trial_run(ctx, name, params)
    selection = Selection([(sc.label, CloudRouteEnv(sc.bundle, eval_env_config(ctx.eval_cfg, sc.rate),
                                                    history=sc.history)) for sc in ctx.selection],
                          ctx.eval_cfg.seed, make_baseline("greedy", ctx.eval_cfg), cfg.data.gate_margin,
                          cfg.data.gate_margin_rel, cfg.net.affinity_guard)
    meta = {"bundle_hash": ctx.bundle_hash, "trial": name, "params": params,
            "mlflow_run_id": mlrun.info.run_id if mlrun is not None else None}
    validation = ValidationCallback(selection, cfg.eval_every, meta, report=report, log_mlflow=mlrun is not None)
    callbacks = [validation, ProgressCallback(cfg.progress_every, validation, report=report,
                                              log_mlflow=mlrun is not None, probe=ctx.warm_data)]
    warm = None
    if ctx.warm_data is not None and len(ctx.warm_data):
        warm = WarmStartCallback(ctx.warm_data, cfg.warm_start, gamma, seed, log_mlflow=mlrun is not None,
                                 validation=validation, cache=ctx.warm_cache)
        callbacks.insert(0, warm)
    t0 = time.perf_counter()
    try:
        # SB3's own logger writes into the trial's directory (its default is a fresh /tmp/SB3-<time>)
        from stable_baselines3.common.logger import configure as sb3_logger

        model.set_logger(sb3_logger(str(out / "sb3"), ["csv"]))
        model.learn(total_timesteps=cfg.total_timesteps, callback=callbacks)
        validation.finish(model)
        wall = time.perf_counter() - t0
        best = validation.best
        assert best is not None
        initial = validation.initial if validation.initial is not None else best
        for w in (best.weights, initial.weights):  # (the guard serves with them: models.policy.holds)
            w.affinity_guard = cfg.net.affinity_guard
        warm_dir = save_router(initial.weights, out / "router" / "warm_start_only")
        last_dir = save_router(validation.last.weights, out / "router" / "last") \
            if ctx.save_last and validation.last is not None else None
        # the departure rule around greedy's choice (models.policy.departs): the margin calibrated on the
        # selection windows -- the largest margin the selection cannot tell from the best worst-case Δ among
        # margins no window is significantly worse at (models.callbacks.pick_margin)
        margin, assessed = calibrate_margin(selection, best.weights, list(cfg.net.margins))
        margins = {m: a.score for m, a in assessed.items()}
        mbest = best_margin(assessed)
        router_dir = save_router(best.weights, out / "router")
        result = {
            "trial": name, **params, "best_step": best.step, "wall_s": round(wall, 1),
            **{f"val_{k}": v for k, v in best.run.metrics.items() if isinstance(v, (int, float))},
            "val_criterion": margins[margin], "margin": margin, "margin_best": mbest,
            "margins": {str(m): v for m, v in margins.items()},
            # per margin: the 95 % interval of its score minus the best margin's, paired (pick_margin's step 3)
            "margin_gaps": {str(m): list(score_gap(a, assessed[mbest])) for m, a in assessed.items()},
            "margin_windows": {str(m): a.windows for m, a in assessed.items()},
            "departures": {w["window"]: w["departures"] for w in assessed[margin].windows},
            "val_criterion_no_margin": best.criterion, "warm_start_val_criterion": initial.criterion,
            "warm_start_best_epoch": warm.report.best_epoch if warm is not None and warm.report is not None else None,
            "router_dir": str(router_dir), "warm_dir": str(warm_dir), "mlflow_run_id": meta["mlflow_run_id"],
            "last_dir": str(last_dir) if last_dir is not None else None, "last_step": validation.curve[-1][0],
            "curve": validation.curve,
            "steps_per_s": round(cfg.total_timesteps / max(wall, 1e-9), 1),
        }
        (out / "router" / "trial.json").write_text(json.dumps(result, indent=2, default=str))
        if mlrun is not None:
            tracking.log_trial_artifacts(ctx, validation, best, out, result, warm)
    finally:
        if mlrun is not None:
            tracking.end_run()
    if report is not None:
        report({"timesteps": cfg.total_timesteps, "val_criterion": validation.last_reward,
                "best_val_criterion": result["val_criterion"], "best_step": best.step,
                "margin": min(float(result["margin"]), 1e9),  # (+inf, greedy: Tune's loggers refuse infinities)
                "train_reward": validation.train_reward(), "done": 1}, str(out / "router"))
    return result

