"""``xroute train``: DQN trials in parallel with Ray Tune, tracked and registered in MLflow.

Flow (``run_training``):

1. The scenarios (``models.scenarios``): the train windows of several real bundles, each also with
   a perturbed catalog, at several loads; a selection window of a bundle not trained on; the gate's
   test windows of every bundle at two loads.
2. Every baseline on the selection window (the table each trial is compared to).
3. The warm start's rollout labels, collected once over the training mix (``models.warmstart``).
4. Ray Tune runs one function trial per grid point (seeds x gamma x learning rate), at most
   ``ray.max_concurrent_trials`` at a time, one torch thread each. A trial (``run_trial``, which
   runs without Ray too) fits the warm start (keeping the epoch that decides best on the selection
   window), trains ``MaskedDQN`` on the training mix, validates the numpy export on the selection
   window every ``eval_every`` steps and keeps its best checkpoint, and its warm start alone for the
   ablation. It logs params, learning curves, tables and plots to its own MLflow run.
5. The best trial (by selection-window reward) and its warm start alone are run beside every
   baseline on the gate scenarios, paired by seed (``models.gate``); the verdict -- does it beat the
   best baseline on data no selection saw, and lose nowhere? -- is recorded with the model, logged
   as an MLflow pyfunc model, registered and given the alias ``challenger``. ``xroute promote``
   moves ``champion`` only when the gate passed.

Ray is only touched in ``_tune_trials``; everything else is plain functions.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from models.config import TrainConfig
from models.scenarios import (
    SPLITS,
    Scenario,
    ScenarioMix,
    Splits,
    build_scenarios,
    resolve_bundle,
    split_bundle,
)
from xroute.bundle import Bundle
from xroute.config import EnvConfig, EvaluateConfig
from xroute.errors import ConfigError, XrouteError

Report = Callable[[dict[str, Any], "str | None"], None]
__all__ = ["SPLITS", "Splits", "resolve_bundle", "run_training", "split_bundle"]


def train_env_config(cfg: TrainConfig, eval_cfg: EvaluateConfig, n_offerings: int) -> EnvConfig:
    """The evaluate config's env (same reward, same dynamics) with training episodes and padding."""
    pad = cfg.max_offerings or max(n_offerings, 1)
    if pad < n_offerings:
        raise ConfigError(f"train config: field 'max_offerings': the bundle has {n_offerings} offerings, more than {pad}")
    return eval_cfg.env.model_copy(update={"episode_requests": cfg.episode_requests, "max_offerings": pad})


def eval_env_config(eval_cfg: EvaluateConfig, rate_scale: float | None = None) -> EnvConfig:
    upd: dict[str, Any] = {"episode_requests": None}
    if rate_scale is not None:
        upd["rate_scale"] = rate_scale
    return eval_cfg.env.model_copy(update=upd)


# ------------------------------------------------------------------------------------------ trial
@dataclass
class TrialContext:
    """What every trial needs; shipped once to the Ray object store (``tune.with_parameters``)."""

    cfg: TrainConfig
    eval_cfg: EvaluateConfig
    train: list[Scenario]
    selection: list[Scenario]
    bundle_hash: str
    baseline_runs: list[Any]  # xroute.evaluate.PolicyResult on the selection window
    warm_data: Any = None  # models.warmstart.RolloutData, shared by all trials
    max_offerings: int = 0  # observation padding: the largest catalog of every scenario
    tracking_uri: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None
    out_dir: str = ""
    extra_params: dict[str, Any] = field(default_factory=dict)


def trial_name(params: dict[str, Any]) -> str:
    return f"s{params['seed']}-g{params['gamma']:g}-lr{params['learning_rate']:g}"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def best_baseline(runs: list[Any]) -> Any:
    """The baseline with the best mean reward, the hindsight oracle excluded (it is a reference,
    not a policy anyone can run)."""
    cands = [r for r in runs if r.name != "oracle"]
    return max(cands, key=lambda r: r.metrics["mean_reward"])


def run_trial(params: dict[str, Any], ctx: TrialContext, report: Report | None = None) -> dict[str, Any]:
    """Train one DQN agent; returns its best validation metrics and the export directory.

    ``params``: ``seed``, ``gamma``, ``learning_rate``. ``report(metrics, checkpoint_dir)`` is
    called with progress (``checkpoint_dir`` only on the last call). Works without Ray."""
    import torch as th

    th.set_num_threads(1)
    from envs.cloud_route import CloudRouteEnv
    from models.callbacks import ProgressCallback, ValidationCallback, WarmStartCallback
    from models.policy import RewardPrior, save_router
    from models.qnet import MaskedDQN, SharedScorerDQNPolicy

    cfg, seed = ctx.cfg, int(params["seed"])
    gamma, lr = float(params["gamma"]), float(params["learning_rate"])
    name = trial_name(params)
    out = Path(ctx.out_dir or ".") / name
    out.mkdir(parents=True, exist_ok=True)
    env_cfg = train_env_config(cfg, ctx.eval_cfg, ctx.max_offerings)
    env = ScenarioMix([CloudRouteEnv(sc.bundle, env_cfg, history=sc.history) for sc in ctx.train], cfg.rate_scales,
                      seed)
    d = cfg.dqn
    model = MaskedDQN(
        SharedScorerDQNPolicy, env, learning_rate=lr, gamma=gamma, buffer_size=d.buffer_size,
        learning_starts=d.learning_starts, batch_size=d.batch_size, tau=d.tau, train_freq=d.train_freq,
        gradient_steps=d.gradient_steps, target_update_interval=d.target_update_interval,
        exploration_fraction=d.exploration_fraction, exploration_initial_eps=d.exploration_initial_eps,
        exploration_final_eps=d.exploration_final_eps, max_grad_norm=d.max_grad_norm, seed=seed, device="cpu",
        policy_kwargs={"net_arch": list(cfg.net.hidden), "context_dim": cfg.net.context_dim,
                       "prior": asdict(RewardPrior.from_env_config(env_cfg)) if cfg.net.reward_prior else None},
    )
    mlrun = _start_trial_run(ctx, name, params)
    from models.baselines import make_baseline
    from models.callbacks import Selection

    selection = Selection([(sc.label, CloudRouteEnv(sc.bundle, eval_env_config(ctx.eval_cfg, sc.rate),
                                                    history=sc.history)) for sc in ctx.selection],
                          ctx.eval_cfg.seed, make_baseline("greedy", ctx.eval_cfg))
    meta = {"bundle_hash": ctx.bundle_hash, "trial": name, "params": params,
            "mlflow_run_id": mlrun.info.run_id if mlrun is not None else None}
    validation = ValidationCallback(selection, cfg.eval_every, meta, report=report, log_mlflow=mlrun is not None)
    callbacks = [validation, ProgressCallback(cfg.progress_every, validation, report=report,
                                              log_mlflow=mlrun is not None)]
    warm = None
    if ctx.warm_data is not None and len(ctx.warm_data):
        warm = WarmStartCallback(ctx.warm_data, cfg.warm_start, gamma, seed, log_mlflow=mlrun is not None,
                                 validation=validation)
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
        warm_dir = save_router(initial.weights, out / "router" / "warm_start_only")
        # the trust region around greedy's choice: the margin that scores best on the selection windows
        margins = {}
        for m in cfg.net.margins:
            best.weights.margin = float(m)
            margins[float(m)] = float(selection.score(best.weights)[0])
        margin = max(margins, key=lambda m: (margins[m], -m))
        best.weights.margin = margin
        router_dir = save_router(best.weights, out / "router")
        result = {
            "trial": name, **params, "best_step": best.step, "wall_s": round(wall, 1),
            **{f"val_{k}": v for k, v in best.run.metrics.items() if isinstance(v, (int, float))},
            "val_criterion": margins[margin], "margin": margin, "margins": margins,
            "val_criterion_no_margin": best.criterion, "warm_start_val_criterion": initial.criterion,
            "warm_start_best_epoch": warm.report.best_epoch if warm is not None and warm.report is not None else None,
            "router_dir": str(router_dir), "warm_dir": str(warm_dir), "mlflow_run_id": meta["mlflow_run_id"],
            "steps_per_s": round(cfg.total_timesteps / max(wall, 1e-9), 1),
        }
        (out / "router" / "trial.json").write_text(json.dumps(result, indent=2, default=str))
        if mlrun is not None:
            _log_trial_artifacts(ctx, validation, best, out, result, warm)
    finally:
        if mlrun is not None:
            import mlflow

            mlflow.end_run()
    if report is not None:
        report({"timesteps": cfg.total_timesteps, "val_criterion": validation.last_reward,
                "best_val_criterion": result["val_criterion"], "best_step": best.step, "margin": result["margin"],
                "train_reward": validation.train_reward(), "done": 1}, str(out / "router"))
    return result


def _start_trial_run(ctx: TrialContext, name: str, params: dict[str, Any]) -> Any:
    if ctx.tracking_uri is None:
        return None
    import mlflow

    from models.loader import quiet_mlflow

    quiet_mlflow()
    mlflow.set_tracking_uri(ctx.tracking_uri)
    tags = {"xroute.trial": name, "xroute.bundle_hash": ctx.bundle_hash}
    if ctx.parent_run_id:
        tags["mlflow.parentRunId"] = ctx.parent_run_id
    run = mlflow.start_run(experiment_id=ctx.experiment_id, run_name=name, tags=tags)
    cfg_flat = flatten(ctx.cfg.model_dump(mode="json"))
    logged = {**{f"config.{k}": v for k, v in cfg_flat.items()}, **params, "bundle_hash": ctx.bundle_hash,
              **ctx.extra_params}
    items = list(logged.items())
    for i in range(0, len(items), 90):  # log_params takes at most 100 per call
        mlflow.log_params({k: str(v)[:500] for k, v in items[i:i + 90]})
    return run


def _log_trial_artifacts(ctx: TrialContext, validation: Any, best: Any, out: Path, result: dict[str, Any],
                         warm: Any = None) -> None:
    import mlflow

    from xroute import evaluate as ev

    runs = [*ctx.baseline_runs, best.run]
    table = {r.name: r.metrics for r in runs}
    (out / "validation_table.json").write_text(json.dumps(table, indent=2, default=float))
    (out / "validation_table.md").write_text(ev.markdown_table(runs))
    ev.plot(runs, out / "cost_vs_p95_validation.png", title=f"validation window — {result['trial']}")
    validation.plot_curve(out / "learning_curve.png", ctx.baseline_runs, warm)
    for f in ("validation_table.json", "validation_table.md", "cost_vs_p95_validation.png", "learning_curve.png"):
        mlflow.log_artifact(str(out / f))
    mlflow.log_artifacts(str(out / "router"), artifact_path="router_export")
    bb = best_baseline(ctx.baseline_runs)
    mlflow.log_metrics({"best_val_criterion": result["val_criterion"], "margin": result["margin"],
                        "best_val_mean_reward": best.run.metrics["mean_reward"], "best_step": best.step,
                        "val_sla_attainment": best.run.metrics["sla_attainment"],
                        "baseline_val_mean_reward": bb.metrics["mean_reward"],
                        "val_reward_gain_vs_best_baseline": best.run.metrics["mean_reward"] - bb.metrics["mean_reward"],
                        "wall_s": result["wall_s"]})


# ------------------------------------------------------------------------------------------ warm start
def collect_chunk(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], n_states: int, seed: int,
                  progress_output: bool = False) -> Any:
    """Label ``n_states`` states of the training mix for the warm start (one process, one thread)."""
    from envs.cloud_route import CloudRouteEnv
    from models import warmstart as ws

    c = cfg.warm_start
    mix = ScenarioMix([CloudRouteEnv(sc.bundle, env_cfg, history=sc.history) for sc in scenarios], cfg.rate_scales,
                      seed)
    every = max(1, n_states // 5)
    t0 = time.perf_counter()

    def progress(k: int) -> None:  # printed by the Ray task; Ray forwards it to the driver's console
        if k % every == 0 and k < n_states:
            print(f"warm start: {k}/{n_states} states labelled ({time.perf_counter() - t0:.0f} s)", flush=True)

    return ws.collect(mix.pick, n_states, c.horizon, c.top_k, c.random_actions, c.stride, c.behaviour_epsilon,
                      np.random.default_rng(seed), progress if progress_output else None)


def collect_warm_start(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], use_ray: bool,
                       echo: Callable[[str], None]) -> Any:
    """The shared warm-start data set, labelled in ``ray.max_concurrent_trials`` parallel chunks."""
    from models.warmstart import RolloutData

    n = cfg.warm_start.samples
    if n <= 0:
        return None
    k = max(1, min(cfg.ray.max_concurrent_trials, n)) if use_ray else 1
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    seeds = [cfg.seed * 1000 + 17 + i for i in range(k)]
    t0 = time.perf_counter()
    echo(f"warm start: labelling {n} states of {len(scenarios)} training scenarios by {cfg.warm_start.horizon}-request "
         "rollouts "
         f"({k} parallel task{'s' if k > 1 else ''}) ...")
    if use_ray:
        import ray

        task = ray.remote(num_cpus=cfg.ray.cpus_per_trial)(_collect_task)
        ref = ray.put(scenarios)
        pending = [task.remote(cfg, env_cfg, ref, m, sd) for m, sd in zip(sizes, seeds)]
        waiting = list(pending)
        while waiting:  # progress from the driver: the tasks' own output stays in Ray's logs
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=30.0)
            if waiting:
                echo(f"warm start: {len(pending) - len(waiting)} of {len(pending)} labelling tasks finished "
                     f"({time.perf_counter() - t0:.0f} s)")
        parts = ray.get(pending)
    else:
        parts = [collect_chunk(cfg, env_cfg, scenarios, m, sd) for m, sd in zip(sizes, seeds)]
    data = RolloutData.concat(parts)
    echo(f"warm start: {len(data)} states in {time.perf_counter() - t0:.0f} s; "
         f"{100 * float((data.advantage > 1e-9).mean()):.1f}% of candidates beat greedy's choice over the horizon")
    return data


def _collect_task(cfg: TrainConfig, env_cfg: EnvConfig, scenarios: list[Scenario], n: int, seed: int) -> Any:
    import torch as th

    th.set_num_threads(1)
    return collect_chunk(cfg, env_cfg, scenarios, n, seed, progress_output=True)


# ------------------------------------------------------------------------------------------ driver
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


CHALLENGER, WARM_ONLY = "dqn (challenger)", "warm start only"


def run_training(cfg: TrainConfig, telemetry: str | Path | None = None, ray_address: str | None = None,
                 echo: Callable[[str], None] = print, use_ray: bool = True) -> TrainSummary:
    """The whole ``xroute train`` (see the module docstring)."""
    import mlflow

    from models import gate, loader, registry
    from models.baselines import BASELINES
    from xroute import evaluate as ev

    t_start = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if use_ray:
        check_ray_address(ray_address)
    run_dir = cfg.run_path()
    run_dir.mkdir(parents=True, exist_ok=True)
    sc = build_scenarios(cfg, telemetry)
    eval_cfg = cfg.evaluate_settings()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    echo(f"training: {', '.join(s.label for s in sc.train)} (train windows), loads x{', x'.join(map(str, cfg.rate_scales))}")
    echo(f"selection: {', '.join(x.label for x in sc.selection)} (validation window, "
         f"{len(sc.selection[0].bundle.workload)} requests)")
    echo(f"gate: {', '.join(s.label for s in sc.gate)} (test windows, {cfg.data.gate_seeds} seeds)")
    bundle_hash = ",".join(f"{k}={v}" for k, v in sc.bundle_hashes.items())

    uri = loader.tracking_uri(run_dir, cfg.mlflow.tracking_uri)
    exp_id = registry.setup(uri, cfg.mlflow.experiment, run_dir)
    echo(f"MLflow: {uri} (experiment '{cfg.mlflow.experiment}')")

    echo("baselines on the selection window ...")
    sel = sc.selection[0]
    sel_cfg = eval_cfg.model_copy(update={"env": eval_env_config(eval_cfg, sel.rate)})
    baseline_runs = ev.evaluate(sel.bundle, [b for b in BASELINES if b != "oracle"], sel_cfg, show_progress=False,
                                seeds=cfg.data.gate_seeds, history=sel.history)
    bb = best_baseline(baseline_runs)
    echo(f"best baseline on the selection window: {bb.name} (mean reward {bb.metrics['mean_reward']:.5f})")

    parent = mlflow.start_run(experiment_id=exp_id, run_name=f"train-{stamp}", tags={"xroute.bundle_hash": bundle_hash})
    try:
        mlflow.log_params({"bundles": bundle_hash[:490], "selection": ",".join(x.label for x in sc.selection),
                           "gate": ",".join(s.label for s in sc.gate)[:490]})
        mlflow.log_dict(sc.describe(), "scenarios.json")
        mlflow.log_dict(cfg.model_dump(mode="json"), "train_config.json")
        mlflow.log_text(ev.markdown_table(baseline_runs), "baselines_selection.md")
        out_dir = run_dir / "trials" / stamp
        ctx = TrialContext(cfg=cfg, eval_cfg=eval_cfg, train=sc.train, selection=sc.selection, bundle_hash=bundle_hash,
                           baseline_runs=baseline_runs, max_offerings=sc.max_offerings, tracking_uri=uri,
                           experiment_id=exp_id, parent_run_id=parent.info.run_id, out_dir=str(out_dir),
                           extra_params={"selection": sel.label})
        points = grid(cfg)
        env_cfg = train_env_config(cfg, eval_cfg, sc.max_offerings)
        with _ray_session(cfg, ray_address, use_ray):
            ctx.warm_data = collect_warm_start(cfg, env_cfg, sc.train, use_ray, echo)
            echo(f"{len(points)} trials x {cfg.total_timesteps} DQN steps, "
                 f"at most {cfg.ray.max_concurrent_trials} at a time")
            if use_ray:
                trials = _tune_trials(cfg, ctx, points, run_dir / "tune", f"train-{stamp}", echo)
            else:
                trials = [run_trial(p, ctx) for p in points]
        best = max(trials, key=lambda t: t["val_criterion"])
        echo(f"best trial: {best['trial']} (worst Δ reward vs greedy over the selection loads {best['val_criterion']:+.5f}"
             f" with margin {best['margin']:g}; {best['val_criterion_no_margin']:+.5f} without; checkpoint at step "
             f"{best['best_step']}; its warm start alone {best['warm_start_val_criterion']:+.5f})")

        # the gate: test windows no selection saw, paired by seed
        routers = {CHALLENGER: best["router_dir"], WARM_ONLY: best["warm_dir"]}
        gate_runs = gate.evaluate_gate(sc.gate, routers, eval_cfg, cfg.data.gate_seeds,
                                       [b for b in BASELINES if b != "oracle"], echo)
        decision = gate.decide(gate_runs, CHALLENGER)
        ablation = gate.decide(gate_runs, WARM_ONLY)
        echo(f"gate: {'PASSED' if decision.passed else 'refused'}: {decision.reason}")
        table = gate.markdown(gate_runs, [CHALLENGER, WARM_ONLY])
        mlflow.log_text(table, "gate.md")
        for r in gate_runs:
            slug = r.label.replace(" ", "_")
            mlflow.log_text(ev.markdown_table(r.results), f"gate/{slug}.md")
            png = out_dir / f"gate_{slug}.png"
            ev.plot(r.results, png, title=f"gate: {r.label} (test window), {cfg.data.gate_seeds} seeds")
            mlflow.log_artifact(str(png), "gate")
        mlflow.log_metrics({"gate_reward_delta": decision.pooled[0], "gate_reward_delta_lo": decision.pooled[1],
                            "warm_start_gate_reward_delta": ablation.pooled[0],
                            "best_val_criterion": best["val_criterion"]})
    finally:
        mlflow.end_run()

    model_uri, version = _log_and_register(cfg, best, bb, decision, ablation, sc.selection[0], uri, echo)
    return TrainSummary(best=best, trials=trials, scenarios=sc.describe(), gate=gate_runs, decision=decision,
                        ablation=ablation, model_uri=model_uri, registered_version=version, tracking_uri=uri,
                        wall_s=time.perf_counter() - t_start)


def _input_example(bundle: Bundle, eval_cfg: EvaluateConfig, k: int = 3) -> pd.DataFrame:
    from envs.cloud_route import CloudRouteEnv
    from models.pyfunc import example_frame

    env = CloudRouteEnv(bundle, eval_env_config(eval_cfg))
    obs, info = env.reset(seed=0)
    observations, ids = [], []
    for _ in range(k):
        observations.append({key: v.copy() for key, v in obs.items()})
        ids.append(str(info["request_id"]))
        obs, _, _, _, info = env.step(int(np.argmax(env.expected_rewards())))
    return example_frame(observations, env.n, ids)


def _log_and_register(cfg: TrainConfig, best: dict[str, Any], bb: Any, decision: Any, ablation: Any,
                      sel: Scenario, uri: str, echo: Callable[[str], None]) -> tuple[str | None, str | None]:
    import mlflow

    from models import registry

    mlflow.set_tracking_uri(uri)
    example = _input_example(sel.bundle, cfg.evaluate_settings())
    run_id = best.get("mlflow_run_id")
    with mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run():
        info = registry.log_router_model(best["router_dir"], example)
    tags = {"val_mean_reward": best["val_mean_reward"], "val_sla_attainment": best["val_sla_attainment"],
            "best_baseline": bb.name, "baseline_val_mean_reward": bb.metrics["mean_reward"],
            "baseline_val_sla_attainment": bb.metrics["sla_attainment"], "trial": best["trial"],
            "best_step": best["best_step"], "margin": best["margin"], "val_criterion": best["val_criterion"],
            "selection": sel.label, **decision.tags("gate"),
            **{k: v for k, v in ablation.tags("warm_start_gate").items() if not k.endswith("_reason")}}
    version = registry.register(info.model_uri, cfg.mlflow.registered_model, registry.CHALLENGER, tags)
    echo(f"registered {cfg.mlflow.registered_model} v{version} -> alias '{registry.CHALLENGER}' "
         f"(models:/{cfg.mlflow.registered_model}@{registry.CHALLENGER})")
    return info.model_uri, version


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast on an unreachable ``--ray-address`` (``ray.init`` itself retries for minutes).
    ``auto`` and ``ray://`` client addresses are left to Ray."""
    if not address or address == "auto" or "://" in address:
        return
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address: '{address}' is not HOST:PORT (e.g. 10.0.0.5:6379), 'auto' or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise XrouteError(f"--ray-address: cannot reach the Ray head at {address} ({e.strerror or e})") from None


def keep_ray_out_of_home() -> None:
    """Ray >= 2.5x enables token auth for a new local cluster and, unless told otherwise, writes
    the token to ``~/.ray/auth_token``. Hand it a fresh per-process token in ``RAY_AUTH_TOKEN``
    instead (auth stays on, nothing is written to the home directory). A token the user set up
    (``RAY_AUTH_*`` variables or an existing token file) is left alone."""
    import secrets

    if any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    if (Path.home() / ".ray" / "auth_token").exists():
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


@contextmanager
def _ray_session(cfg: TrainConfig, ray_address: str | None, use_ray: bool) -> Iterator[None]:
    """Ray for the duration of training: the caller's if already initialized (tests), else an
    existing cluster (``ray_address``) or a local instance, shut down afterwards."""
    if not use_ray:
        yield
        return
    import ray

    started = False
    if not ray.is_initialized():
        try:
            if ray_address:
                ray.init(address=ray_address, include_dashboard=False, logging_level=logging.ERROR,
                         log_to_driver=False)
            else:
                keep_ray_out_of_home()
                ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, logging_level=logging.ERROR,
                         log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise XrouteError(f"--ray-address: cannot start or reach Ray at '{ray_address or 'local'}': {first}") from None
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _tune_trials(cfg: TrainConfig, ctx: TrialContext, points: list[dict[str, Any]], storage: Path, name: str,
                 echo: Callable[[str], None]) -> list[dict[str, Any]]:
    import sys

    from ray import tune

    trainable = tune.with_resources(tune.with_parameters(_tune_trainable, ctx=ctx),
                                    {"cpu": cfg.ray.cpus_per_trial})
    space = {
        "seed": tune.grid_search(sorted({p["seed"] for p in points})),
        "gamma": tune.grid_search(sorted({p["gamma"] for p in points})),
        "learning_rate": tune.grid_search(sorted({p["learning_rate"] for p in points})),
    }
    storage.mkdir(parents=True, exist_ok=True)
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(max_concurrent_trials=cfg.ray.max_concurrent_trials),
        run_config=tune.RunConfig(name=name, storage_path=str(storage.resolve()), verbose=0,
                                  callbacks=[_TrialLines()],
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    # Tune prints its own header and hints whatever the verbosity: into a file beside its results,
    # so the console shows only the lines a user acts on (``_TrialLines``, written to the real stdout)
    import contextlib

    (storage / name).mkdir(parents=True, exist_ok=True)
    _CONSOLE.append(_to(sys.stdout, echo))
    try:
        with open(storage / name / "tune_console.log", "a") as console, contextlib.redirect_stdout(console):
            grid_results = tuner.fit()
    finally:
        _CONSOLE.pop()
    trials = []
    errors = []
    for i in range(len(grid_results)):
        r = grid_results[i]
        if r.error is not None:
            errors.append(r.error)
            continue
        if r.checkpoint is None:
            continue
        with r.checkpoint.as_directory() as d:
            info = json.loads((Path(d) / "trial.json").read_text())
        # the checkpoint (not the worker's scratch directory) is where the export lives for good
        info["router_dir"] = r.checkpoint.to_directory(str(storage / name / "exports" / info["trial"]))
        trials.append(info)
    if not trials:
        first = str(errors[0]).strip().splitlines()[-1] if errors else "no trial reported a result"
        raise XrouteError(f"training failed: every trial failed ({first}); see {storage / name}")
    if errors:
        echo(f"warning: {len(errors)} trial(s) failed; see {storage / name}")
    return trials


def _to(stream: Any, echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` writing to ``stream`` (the real stdout, taken before Tune's console output is
    redirected): print and typer's echo write to whatever ``sys.stdout`` is at call time."""
    import sys

    def out(msg: str) -> None:
        saved = sys.stdout
        sys.stdout = stream
        try:
            echo(msg)
        finally:
            sys.stdout = saved

    return out


#: where ``_TrialLines`` writes while Tune runs (module state, not captured by the callback: Tune
#: pickles its callbacks, and a console stream does not pickle)
_CONSOLE: list[Callable[[str], None]] = []


def _emit(msg: str) -> None:
    if _CONSOLE:
        _CONSOLE[-1](msg)


class _TrialLines:
    """One line per trial event a user acts on (Tune's own status tables are off: ``verbose=0``)."""

    def __new__(cls) -> Any:
        from ray import tune

        echo = _emit

        class Lines(tune.Callback):  # type: ignore[misc]
            def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                                **info: Any) -> None:
                if result.get("done_validation"):
                    echo(f"trial {trial_name(trial.config)}: step {result.get('timesteps', 0)}, worst Δ reward vs "
                         f"greedy on the selection windows {result.get('val_criterion', float('nan')):+.5f}")

            def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
                r = trial.last_result or {}
                echo(f"trial {trial_name(trial.config)} done: {r.get('best_val_criterion', float('nan')):+.5f} "
                     f"(step {r.get('best_step', '?')}, margin {r.get('margin', '?')})")

            def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
                echo(f"trial {trial_name(trial.config)} failed (see the Tune directory)")

        return Lines()


def _tune_trainable(config: dict[str, Any], ctx: TrialContext) -> None:
    from ray import tune

    def report(metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            tune.report(metrics)
        else:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(checkpoint_dir))

    run_trial({"seed": int(config["seed"]), "gamma": float(config["gamma"]),
               "learning_rate": float(config["learning_rate"])}, ctx, report)
