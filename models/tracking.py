"""MLflow tracking of ``xroute train``: the training's parent run (its scenarios, config, the
baselines on the selection window, the gate's tables and plots), each trial's run (params,
metrics per step, the validation table, the learning-curve plot, the export), and the best
trial's model logged and registered with the gate's verdict (``models.registry``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd

from envs.cloud_route import CloudRouteEnv
from models import evaluate as ev
from models import registry
from models.config import TrainConfig
from models.loader import quiet_mlflow
from models.pyfunc import example_frame
from models.scenarios import Scenario, Scenarios, eval_env_config
from xroute.bundle import Bundle
from xroute.config import EvaluateConfig
from xroute.errors import XrouteError


def best_baseline(runs: list[Any]) -> Any:
    """The baseline with the best mean reward (``models.evaluate.best_baseline``: the hindsight
    oracle is a reference, not a policy anyone can run)."""
    bb = ev.best_baseline(runs)
    if bb is None:
        raise XrouteError("no baseline ran on the selection window")
    return bb


def log_step_metrics(metrics: dict[str, float], step: int) -> None:
    """``metrics`` at ``step`` in the active run, the missing and non-finite left out."""
    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)}, step=step)


def end_run() -> None:
    mlflow.end_run()


# ------------------------------------------------------------------------------------------ the training's run
@contextmanager
def training_run(experiment_id: str, name: str, bundle_hash: str) -> Iterator[Any]:
    """The parent run of one ``xroute train`` (its trials' runs are its children), ended on exit."""
    parent = mlflow.start_run(experiment_id=experiment_id, run_name=name, tags={"xroute.bundle_hash": bundle_hash})
    try:
        yield parent
    finally:
        mlflow.end_run()


def log_training_inputs(cfg: TrainConfig, sc: Scenarios, bundle_hash: str, baseline_runs: list[Any]) -> None:
    """What the training learns from, selects on and is judged on, its config, and the baselines
    on the selection window, into the active (parent) run."""
    mlflow.log_params({"bundles": bundle_hash[:490], "selection": ",".join(x.label for x in sc.selection),
                       "gate": ",".join(s.label for s in sc.gate)[:490]})
    mlflow.log_dict(sc.describe(), "scenarios.json")
    mlflow.log_dict(cfg.model_dump(mode="json"), "train_config.json")
    mlflow.log_text(ev.markdown_table(baseline_runs), "baselines_selection.md")


def log_gate(gate_table: str, gate_runs: list[Any], decision: Any, ablation: Any, best: dict[str, Any], out_dir: Path,
             seeds: int, families_table: str = "") -> None:
    """The gate's table, its table by family, each scenario's table and plot, and its verdicts,
    into the active run (each family's paired Δ to greedy as metrics ``gate_family_delta.<name>``
    and ``..._lo``; each scenario's share of the challenger's departures from greedy's choice as
    ``gate_departures.<scenario>``)."""
    mlflow.log_text(gate_table, "gate.md")
    if families_table:
        mlflow.log_text(families_table, "gate_families.md")
    for fam, (m, lo, _) in decision.families.items():
        mlflow.log_metrics({f"gate_family_delta.{fam}": m, f"gate_family_delta_lo.{fam}": lo})
    for r in gate_runs:
        slug = r.label.replace(" ", "_")
        mlflow.log_text(ev.markdown_table(r.results), f"gate/{slug}.md")
        png = out_dir / f"gate_{slug}.png"
        ev.plot(r.results, png, title=f"gate: {r.label} (test window), {seeds} seeds")
        mlflow.log_artifact(str(png), "gate")
        share = r.result(decision.candidate).metrics.get("differs_from_greedy")
        if share is not None:  # how often the challenger departs from greedy's choice (models.policy.departs)
            mlflow.log_metric(f"gate_departures.{slug.replace(':', '_')}", float(share))
    mlflow.log_metrics({"gate_reward_delta": decision.pooled[0], "gate_reward_delta_lo": decision.pooled[1],
                        "warm_start_gate_reward_delta": ablation.pooled[0],
                        "best_val_criterion": best["val_criterion"]})


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out



# ------------------------------------------------------------------------------------------ a trial's run
def start_trial_run(ctx: Any, name: str, params: dict[str, Any]) -> Any:
    """The run of trial ``name`` (a child of the training's run) with the config and ``params``
    logged; ``None`` without a tracking URI. ``ctx``: the trial's ``models.trial.TrialContext``."""
    if ctx.tracking_uri is None:
        return None
    quiet_mlflow()
    mlflow.set_tracking_uri(ctx.tracking_uri)
    tags = {"xroute.trial": name, "xroute.bundle_hash": ctx.bundle_hash}
    if ctx.parent_run_id:
        tags["mlflow.parentRunId"] = ctx.parent_run_id
    # (nested when the parent is active in this process: training without Ray, the ablation runner)
    run = mlflow.start_run(experiment_id=ctx.experiment_id, run_name=name, tags=tags,
                           nested=mlflow.active_run() is not None)
    cfg_flat = flatten(ctx.cfg.model_dump(mode="json"))
    logged = {**{f"config.{k}": v for k, v in cfg_flat.items()}, **params, "bundle_hash": ctx.bundle_hash,
              **ctx.extra_params}
    items = list(logged.items())
    for i in range(0, len(items), 90):  # log_params takes at most 100 per call
        mlflow.log_params({k: str(v)[:500] for k, v in items[i:i + 90]})
    return run


def log_trial_artifacts(ctx: Any, validation: Any, best: Any, out: Path, result: dict[str, Any],
                        warm: Any = None) -> None:
    """The trial's validation table and plots, its export and its best metrics, into its run."""
    runs = [*ctx.baseline_runs, best.run]
    table = {r.name: r.metrics for r in runs}
    (out / "validation_table.json").write_text(json.dumps(table, indent=2, default=float))
    (out / "validation_table.md").write_text(ev.markdown_table(runs))
    ev.plot(runs, out / "cost_vs_p95_validation.png", title=f"validation window — {result['trial']}")
    plot_learning_curve(validation, out / "learning_curve.png", ctx.baseline_runs, warm)
    for f in ("validation_table.json", "validation_table.md", "cost_vs_p95_validation.png", "learning_curve.png"):
        mlflow.log_artifact(str(out / f))
    mlflow.log_artifacts(str(out / "router"), artifact_path="router_export")
    bb = best_baseline(ctx.baseline_runs)
    # (the departure margin: +inf, greedy itself, is logged as the metric's largest value, 1e9)
    mlflow.log_metrics({"best_val_criterion": result["val_criterion"], "margin": min(float(result["margin"]), 1e9),
                        "margin_best": min(float(result.get("margin_best", result["margin"])), 1e9),
                        "best_val_mean_reward": best.run.metrics["mean_reward"], "best_step": best.step,
                        "val_sla_attainment": best.run.metrics["sla_attainment"],
                        "baseline_val_mean_reward": bb.metrics["mean_reward"],
                        "val_reward_gain_vs_best_baseline": best.run.metrics["mean_reward"] - bb.metrics["mean_reward"],
                        "wall_s": result["wall_s"]})


def plot_learning_curve(validation: Any, path: str | Path, references: list[Any] | None = None,
                        warm: Any = None) -> None:
    """The learning curve of ``validation`` (the trial's ``models.callbacks.ValidationCallback``)
    and ``warm`` (its ``WarmStartCallback``), three panels a reviewer compares: (1) every
    checkpoint's selection score -- its worst paired difference in mean reward to greedy over the
    selection loads; 0 is greedy -- with the other baselines' differences on the first selection scenario (``references``: their results over
    several seeds, mean and 95 % interval) and the checkpoint kept; (2) the warm start's fit:
    the score after each epoch (epoch 0 = the prior alone, greedy) and the epoch kept; (3) the
    training episodes' reward, which includes exploration and the mix's loads: not comparable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axw, axt) = plt.subplots(1, 3, figsize=(16, 4.5))
    ax.axhline(0.0, color="tab:green", lw=1.5, label="greedy (the reference: Δ = 0)")
    if validation.curve:
        st, r = zip(*validation.curve)
        ax.plot(st, r, "o-", color="tab:blue", label="checkpoints: worst Δ over the selection loads")
    greedy = next((x for x in (references or []) if x.name == "greedy"), None)
    others = sorted((x for x in (references or []) if x.name != "greedy"),
                    key=lambda x: -x.metrics["mean_reward"])[:1]  # the next-best baseline: the scale stays readable
    for k, ref in enumerate(others if greedy is not None else []):
        assert greedy is not None
        d = ref.metrics["mean_reward"] - greedy.metrics["mean_reward"]
        lo, hi = ref.ci["mean_reward"]
        half = (hi - lo) / 2 if np.isfinite(lo) else 0.0
        c = ["tab:orange", "tab:gray"][k]
        ax.axhline(d, color=c, ls="--", lw=1, label=f"{ref.name} (Δ on {validation.selection.envs[0][0]}, ±{half:.4f})")
    if validation.best is not None:
        ax.axvline(validation.best.step, color="gray", ls=":", label=f"kept (step {validation.best.step})")
    ax.set_xlabel("DQN environment steps (0 = the warm start)")
    ax.set_ylabel("Δ mean reward vs greedy, selection windows")
    ax.set_title("selection: checkpoints vs greedy and the baselines")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    rep = getattr(warm, "report", None)
    if rep is not None and rep.selection:
        axw.plot(range(len(rep.selection)), rep.selection, "o-", color="tab:purple", label="worst Δ vs greedy")
        axw.axhline(0.0, color="tab:green", lw=1.5, label="greedy (the prior alone)")
        axw.axvline(rep.best_epoch, color="gray", ls=":", label=f"kept (epoch {rep.best_epoch})")
        axw.set_xlabel("warm-start epoch (0 = the prior alone)")
        axw.legend(fontsize=7)
    else:
        axw.text(0.5, 0.5, "no warm start", ha="center", va="center", transform=axw.transAxes)
    axw.set_title("warm-start fit")
    axw.grid(alpha=0.3)
    if validation.train_curve:
        st, r = zip(*validation.train_curve)
        axt.plot(st, r, color="tab:red", alpha=0.7)
    else:
        axt.text(0.5, 0.5, "no DQN fine-tuning\n(total_timesteps 0: the warm start alone)", ha="center",
                 va="center", transform=axt.transAxes)
    axt.set_xlabel("DQN environment steps")
    axt.set_ylabel("mean reward per request")
    axt.set_title("training episodes (exploration, mixed loads)")
    axt.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the model
def input_example(bundle: Bundle, eval_cfg: EvaluateConfig, k: int = 3) -> pd.DataFrame:
    """The model's input example: the first ``k`` requests of ``bundle`` as the router sees them
    (greedy deciding, so the later ones see its load)."""
    env = CloudRouteEnv(bundle, eval_env_config(eval_cfg))
    obs, info = env.reset(seed=0)
    observations, ids = [], []
    for _ in range(k):
        observations.append({key: v.copy() for key, v in obs.items()})
        ids.append(str(info["request_id"]))
        obs, _, _, _, info = env.step(int(np.argmax(env.expected_rewards())))
    return example_frame(observations, env.n, ids)


def log_and_register(cfg: TrainConfig, best: dict[str, Any], bb: Any, decision: Any, ablation: Any,
                     sel: Scenario, uri: str, echo: Callable[[str], None]) -> tuple[str | None, str | None]:
    """The best trial's export as a pyfunc model in its run, registered with the training's
    verdicts as tags and the ``challenger`` alias. Returns (model URI, version)."""
    mlflow.set_tracking_uri(uri)
    example = input_example(sel.bundle, cfg.evaluate_settings())
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
