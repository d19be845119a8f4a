"""``xroute train-planner``: the learned capacity planner trained in Ray Tune trials, tracked and
registered in MLflow beside the router, promoted only through its gate.

Flow (:func:`run_planner_training`), each step in the module that does it:

1. The windows: the *train* windows of ``data.train`` (training episodes, ``models.planner_train``),
   the *validation* windows of ``data.selection`` at ``data.selection_loads`` (selection), the *test*
   windows of ``data.gate`` at ``data.gate_loads`` (the gate) -- each split as ``xroute train`` splits.
2. Every baseline on the selection windows (penalized cost per seed: what a trial is compared to).
3. The labels, collected once for every trial: the hindsight oracle's plans on ``labels.episodes``
   training episodes and what the spot traces did next (``collect_labels``; Ray tasks).
4. Ray Tune runs one trial per grid point (``trials.seeds`` x ``trials.scorers``), at most
   ``ray.max_concurrent_trials`` at a time, one CPU each. A trial (:func:`run_trial`, which runs
   without Ray too) fits the scorer (``network``) or keeps the zero network (``none``: the
   ablation), searches the knobs on training episodes (the cost-sensitive fine-tune), then tries
   safeguards over the searched knobs on the selection windows (``search.hazard_floors`` x
   ``hedge_floors`` x ``keep_launching``) and keeps the best variant; it logs params,
   curves, its selection table and its export to its own MLflow run (a child of the training's).
5. The best trial by its selection score (and the best ``none`` trial, for the ablation) are played
   beside every baseline and the oracle on the gate windows, paired by seed (``models.planner_gate``);
   the verdict, the gate's table and plot go to the training's MLflow run; the best trial's export is
   logged as an MLflow pyfunc model (``models.planner_pyfunc``), registered as ``mlflow.registered_model``
   (``xroute-planner``) with the verdict as tags and the alias ``challenger``.
   ``xroute promote --model xroute-planner`` moves ``champion`` only when the gate passed.

Ray is imported inside the functions that use it; torch only when a trial fits its scorer.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd

from models import loader, registry
from models.config import PlannerTrainConfig
from models.planner_gate import WindowResult, decide, evaluate_gate, markdown, plot
from models.planner_net import Knobs, PlannerWeights, read_planner, save_planner
from models.planner_train import (
    Episode,
    Labels,
    SelectionWindow,
    Worlds,
    collect_labels,
    fit_scorer,
    safeguarded,
    sample_episodes,
    search_knobs,
    selection_score,
    selection_windows,
)
from models.scenarios import Scenario, resolve_bundle, split_bundle
from xroute.config import CapacityConfig
from xroute.errors import XrouteError

#: the gate's rows: the best trial, and the best trial of the other scorer (the ablation)
CHALLENGER, WITHOUT_NETWORK, WITH_NETWORK = "learned planner (challenger)", "knobs only (no network)", "with the network"


@dataclass
class PlannerTrialContext:
    """What every trial needs; shipped once to the Ray object store."""

    cfg: PlannerTrainConfig
    cap: CapacityConfig
    train: list[Scenario]
    selection: list[SelectionWindow]
    labels: Labels
    out_dir: str
    tracking_uri: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None
    bundle_hash: str = ""


@dataclass
class PlannerTrainSummary:
    best: dict[str, Any]
    trials: list[dict[str, Any]]
    gate: list[WindowResult]
    decision: Any
    ablation: Any
    registered_version: str | None
    model_uri: str | None
    tracking_uri: str
    wall_s: float
    labels: dict[str, Any] = field(default_factory=dict)


def trial_name(params: dict[str, Any]) -> str:
    return f"s{params['seed']}-{params['scorer']}"


# ------------------------------------------------------------------------------------------ the windows
def build_windows(cfg: PlannerTrainConfig, telemetry: str | Path | None = None
                  ) -> tuple[list[Scenario], list[Scenario], list[Scenario], dict[str, str]]:
    """(train, selection, gate) scenarios and the bundles' content hashes (module docstring, step 1)."""
    d = cfg.data
    refs = {"train": d.train, "selection": d.selection, "gate": d.gate}
    if telemetry is not None:
        refs = {k: [str(telemetry)] for k in refs}
    splits: dict[str, Any] = {}
    hashes: dict[str, str] = {}

    def sp(ref: str, field_name: str) -> Any:
        if ref not in splits:
            b = resolve_bundle(ref, "--telemetry" if telemetry is not None else f"planner config: field '{field_name}'")
            splits[ref] = split_bundle(b, cfg.split)
            hashes[Path(ref).name or ref] = b.content_hash
        return splits[ref]

    def label(ref: str) -> str:
        return Path(ref).name or ref

    train = [Scenario(label(r), sp(r, "data.train").bundles["train"], None) for r in refs["train"]]
    selection = [Scenario(label(r), sp(r, "data.selection").bundles["validation"], sp(r, "data.selection").history("validation"))
                 for r in refs["selection"]]
    gate = [Scenario(label(r), sp(r, "data.gate").bundles["test"], sp(r, "data.gate").history("test")) for r in refs["gate"]]
    return train, selection, gate, hashes


# ------------------------------------------------------------------------------------------ one trial
def run_trial(params: dict[str, Any], ctx: PlannerTrialContext,
              report: Callable[[dict[str, Any], str | None], None] | None = None) -> dict[str, Any]:
    """One trial (module docstring, step 4); works without Ray. Returns its result (with ``planner_dir``)."""
    cfg, cap = ctx.cfg, ctx.cap
    seed, scorer = int(params["seed"]), str(params["scorer"])
    name = trial_name(params)
    out = Path(ctx.out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run = _start_trial_run(ctx, name, params)
    try:
        worlds = Worlds(ctx.train, cfg.data.loads, cap)
        layers: list[tuple[np.ndarray, np.ndarray]] = []
        fit = None
        if scorer == "network" and len(ctx.labels) and cfg.fit.epochs > 0:
            f = cfg.fit
            layers, fit = fit_scorer(ctx.labels, list(f.hidden), f.epochs, f.learning_rate, f.weight_decay, f.holdout,
                                     f.risk_weight, seed)
        start = Knobs(margin=0.1, beta=0.5 if layers else 0.0, risk_price=2.0 if layers else 0.0, hazard_price=0.0,
                      relaunch_price=1.0)
        s = cfg.search
        search = search_knobs(worlds, layers, start, s.iterations, s.population, s.episodes, s.elite,
                              cfg.labels.episode_epochs, s.slo_miss_usd, seed)
        searched = PlannerWeights(layers, search.knobs)
        variants: dict[str, tuple[float, dict[str, float], PlannerWeights]] = {}
        for hz in s.hazard_floors:
            for hd in s.hedge_floors:
                for kl in s.keep_launching:
                    w = safeguarded(searched, float(hz), float(hd), bool(kl))
                    crit, per = selection_score(ctx.selection, w, cap, s.slo_miss_usd, s.selection_criterion)
                    variants[f"hazard>={hz:g} hedge>={hd:g} keep={'y' if kl else 'n'}"] = (crit, per, w)
        chosen = min(variants, key=lambda v: (variants[v][0], list(variants).index(v)))
        crit, per, final = variants[chosen]
        final.meta = {"trial": name, "seed": seed, "scorer": scorer, "variant": chosen, "selection_criterion": crit,
                      "bundle_hash": ctx.bundle_hash}
        planner_dir = save_planner(final, out / "planner")
        result = {"trial": name, "seed": seed, "scorer": scorer, "criterion": crit, "selection": per,
                  "variant": chosen, "variants": {k: v[0] for k, v in variants.items()}, "knobs": asdict(final.knobs),
                  "search": {"best": search.best, "elite_mean": search.elite_mean, "start": search.start_score,
                             "final": search.final_score, "seconds": round(search.seconds, 1)},
                  "fit": None if fit is None else {"best_epoch": fit.best_epoch, "states": fit.states, "rows": fit.rows,
                                                   "holdout_loss": fit.holdout_loss[fit.best_epoch],
                                                   "holdout_risk": fit.holdout_risk[fit.best_epoch],
                                                   "holdout_clone": fit.holdout_clone[fit.best_epoch],
                                                   "seconds": round(fit.seconds, 1)},
                  "wall_s": round(time.perf_counter() - t0, 1), "planner_dir": str(planner_dir),
                  "mlflow_run_id": run.info.run_id if run is not None else None}
        (planner_dir / "trial.json").write_text(json.dumps(result, indent=2, default=float))
        if run is not None:
            _log_trial(result, fit, search, out, planner_dir)
    finally:
        if run is not None:
            mlflow.end_run()
    if report is not None:
        report({"criterion": result["criterion"], "variant": result["variant"], "done": 1}, str(planner_dir))
    return result


def _start_trial_run(ctx: PlannerTrialContext, name: str, params: dict[str, Any]) -> Any:
    if ctx.tracking_uri is None:
        return None
    loader.quiet_mlflow()
    mlflow.set_tracking_uri(ctx.tracking_uri)
    tags = {"xroute.trial": name, "xroute.bundle_hash": ctx.bundle_hash}
    if ctx.parent_run_id:
        tags["mlflow.parentRunId"] = ctx.parent_run_id
    run = mlflow.start_run(experiment_id=ctx.experiment_id, run_name=name, tags=tags,
                           nested=mlflow.active_run() is not None)
    flat = _flatten(ctx.cfg.model_dump(mode="json"))
    items = [*({f"config.{k}": v for k, v in flat.items()}).items(), *params.items()]
    for i in range(0, len(items), 90):
        mlflow.log_params({k: str(v)[:500] for k, v in items[i:i + 90]})
    return run


def _log_trial(result: dict[str, Any], fit: Any, search: Any, out: Path, planner_dir: Path) -> None:
    """Curves, the selection table, a plot and the export into the active (trial) run."""
    if fit is not None:
        for k, (tr, ho, hr, hc) in enumerate(zip([float("nan"), *fit.train_loss], fit.holdout_loss, fit.holdout_risk,
                                                 fit.holdout_clone)):
            mlflow.log_metrics({k2: v for k2, v in (("fit_train_loss", tr), ("fit_holdout_loss", ho),
                                                    ("fit_holdout_risk", hr), ("fit_holdout_clone", hc))
                                if np.isfinite(v)}, step=k)
    for k, (b, e) in enumerate(zip(search.best, search.elite_mean)):
        mlflow.log_metrics({"search_best": b, "search_elite_mean": e}, step=k + 1)
    mlflow.log_metrics({"selection_criterion": result["criterion"], "hazard_price": result["knobs"]["hazard_price"],
                        "hedge": result["knobs"]["hedge"], "search_final": search.final_score, "wall_s": result["wall_s"],
                        **{f"selection.{k.replace(' ', '_')}": v for k, v in result["selection"].items()}})
    rows = ["| selection window | ln(penalized cost / best baseline's) |", "|---|---:|",
            *[f"| {k} | {v:+.4f} |" for k, v in result["selection"].items()],
            f"| **the criterion ({result['variant']})** | **{result['criterion']:+.4f}** |", "",
            "| variant (safeguards over the searched knobs) | criterion |", "|---|---:|",
            *[f"| {k} | {v:+.4f} |" for k, v in result["variants"].items()]]
    (out / "selection.md").write_text("\n".join(rows) + "\n")
    _plot_trial(fit, search, result, out / "learning_curve.png")
    mlflow.log_artifact(str(out / "selection.md"))
    mlflow.log_artifact(str(out / "learning_curve.png"))
    mlflow.log_artifacts(str(planner_dir), artifact_path="planner_export")


def _plot_trial(fit: Any, search: Any, result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    if fit is not None:
        a.plot(fit.holdout_risk, label="held-out risk (BCE)")
        a.plot(fit.holdout_clone, label="held-out cloning (CE)")
        a.axvline(fit.best_epoch, color="gray", ls=":", label=f"kept (epoch {fit.best_epoch})")
        a.legend(fontsize=7)
    else:
        a.text(0.5, 0.5, "no network (the ablation)", ha="center", va="center", transform=a.transAxes)
    a.set_title("the scorer's fit")
    a.set_xlabel("epoch")
    b.plot(range(1, len(search.best) + 1), search.best, "o-", label="best candidate")
    b.plot(range(1, len(search.elite_mean) + 1), search.elite_mean, "s--", label="elite mean")
    b.axhline(search.start_score, color="gray", ls=":", label="the start knobs")
    b.set_title("knob search (training episodes; fresh each iteration)")
    b.set_xlabel("iteration")
    b.set_ylabel("mean ln(penalized cost / SpotHedge's)")
    b.legend(fontsize=7)
    names = list(result["variants"])
    c.barh(range(len(names)), [result["variants"][n] for n in names],
           color=["tab:green" if n == result["variant"] else "tab:gray" for n in names])
    c.set_yticks(range(len(names)), names, fontsize=6)
    c.set_title("selection windows: the safeguard variants (kept: green)")
    c.set_xlabel("criterion: ln(penalized cost / best baseline's)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.suptitle(f"trial {result['trial']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------------------------------------ Ray
@contextmanager
def _ray(cfg: PlannerTrainConfig, address: str | None, use_ray: bool) -> Iterator[None]:
    if not use_ray:
        yield
        return
    import logging

    import ray

    from models import tune

    started = False
    if not ray.is_initialized():
        try:
            if address:
                ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
            else:
                tune.start_local_ray(cfg.ray.num_cpus, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = f"--ray-address: cannot reach Ray at '{address}'" if address else "cannot start a local Ray instance"
            raise XrouteError(f"{where}: {loader.first_line(e)}") from None
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _labels(train: list[Scenario], cfg: PlannerTrainConfig, cap: CapacityConfig, episodes: list[Episode],
            use_ray: bool) -> Labels:
    L = cfg.labels
    if not episodes:
        return Labels.empty()
    if not use_ray:
        return collect_labels(Worlds(train, cfg.data.loads, cap), episodes, L.horizon_epochs, L.risk_epochs)
    import ray

    task = ray.remote(num_cpus=1)(_label_task)
    n = max(1, int(cfg.ray.num_cpus))
    chunks = [episodes[k::n] for k in range(n) if episodes[k::n]]
    return Labels.concat(ray.get([task.remote(train, cfg.data.loads, cap, c, L.horizon_epochs, L.risk_epochs)
                                  for c in chunks]))


def _label_task(train: list[Scenario], loads: list[int], cap: CapacityConfig, episodes: list[Episode], horizon: int,
                risk: int) -> Labels:
    return collect_labels(Worlds(train, loads, cap), episodes, horizon, risk)


def _tune(cfg: PlannerTrainConfig, ctx: PlannerTrialContext, points: list[dict[str, Any]], storage: Path, name: str,
          echo: Callable[[str], None]) -> list[dict[str, Any]]:
    from ray import tune

    def trainable(config: dict[str, Any], ctx: PlannerTrialContext) -> None:
        from ray import tune as t

        def report(metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            if checkpoint_dir is None:
                t.report(metrics)
            else:
                t.report(metrics, checkpoint=t.Checkpoint.from_directory(checkpoint_dir))

        run_trial({"seed": int(config["seed"]), "scorer": str(config["scorer"])}, ctx, report)

    runner = tune.with_resources(tune.with_parameters(trainable, ctx=ctx), {"cpu": cfg.ray.cpus_per_trial})
    console = _Console(sys.stdout, echo)
    space = {"seed": tune.grid_search(sorted({p["seed"] for p in points})),
             "scorer": tune.grid_search(sorted({p["scorer"] for p in points}))}
    storage.mkdir(parents=True, exist_ok=True)
    (storage / name).mkdir(parents=True, exist_ok=True)
    tuner = tune.Tuner(runner, param_space=space,
                       tune_config=tune.TuneConfig(max_concurrent_trials=cfg.ray.max_concurrent_trials),
                       run_config=tune.RunConfig(name=name, storage_path=str(storage.resolve()), verbose=0,
                                                 callbacks=[_trial_lines()],
                                                 failure_config=tune.FailureConfig(max_failures=0)))
    # Tune's own console output goes to a file beside its results; one line per trial comes through the callback
    _ECHO.append(console)
    try:
        with open(storage / name / "tune_console.log", "a") as log, redirect_stdout(log):
            grid = tuner.fit()
    finally:
        _ECHO.pop()
    trials, errors = [], []
    for i in range(len(grid)):
        r = grid[i]
        if r.error is not None:
            errors.append(r.error)
            continue
        if r.checkpoint is None:
            continue
        dst = r.checkpoint.to_directory(str(storage / name / "exports" / f"trial-{i}"))
        info = json.loads((Path(dst) / "trial.json").read_text())
        info["planner_dir"] = str(dst)
        trials.append(info)
    if not trials:
        first = str(errors[0]).strip().splitlines()[-1] if errors else "no trial reported a result"
        raise XrouteError(f"planner training failed: every trial failed ({first}); see {storage / name}")
    if errors:
        echo(f"warning: {len(errors)} trial(s) failed; see {storage / name}")
    return trials


class _Console:
    """``echo`` writing to ``stream`` (the real stdout, taken before Tune's output is redirected)."""

    def __init__(self, stream: Any, echo: Callable[[str], None]):
        self.stream, self.echo = stream, echo

    def __call__(self, msg: str) -> None:
        saved = sys.stdout
        sys.stdout = self.stream
        try:
            self.echo(msg)
        finally:
            sys.stdout = saved


#: where the trial lines go while Tune runs (module state: Tune pickles its callbacks, a stream does not pickle)
_ECHO: list[_Console] = []


def _trial_lines() -> Any:
    """A Tune callback: one line when a trial ends (its selection criterion) or fails."""
    from ray import tune

    def emit(msg: str) -> None:
        if _ECHO:
            _ECHO[-1](msg)

    class Lines(tune.Callback):  # type: ignore[misc]
        def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            r = trial.last_result or {}
            emit(f"trial {trial_name(trial.config)}: selection criterion {r.get('criterion', float('nan')):+.4f} "
                 f"({r.get('variant', '?')})")

        def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            emit(f"trial {trial_name(trial.config)} failed (see the Tune directory)")

    return Lines()


# ------------------------------------------------------------------------------------------ the whole run
def run_planner_training(cfg: PlannerTrainConfig, telemetry: str | Path | None = None, ray_address: str | None = None,
                         echo: Callable[[str], None] = print, use_ray: bool = True) -> PlannerTrainSummary:
    """The whole ``xroute train-planner`` (module docstring)."""
    t_start = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if use_ray:
        from models import tune

        tune.check_ray_address(ray_address)
    cap = cfg.capacity_settings()
    miss = cfg.search.slo_miss_usd
    run_dir = cfg.run_path()
    run_dir.mkdir(parents=True, exist_ok=True)
    train, selection, gate_sc, hashes = build_windows(cfg, telemetry)
    bundle_hash = ",".join(f"{k}={v}" for k, v in hashes.items())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    echo(f"planner training: {', '.join(s.label for s in train)} (train windows) at loads x"
         f"{', x'.join(map(str, cfg.data.loads))}")
    echo(f"selection: {', '.join(s.label for s in selection)} (validation windows) at x"
         f"{', x'.join(map(str, cfg.data.selection_loads))}; gate: {', '.join(s.label for s in gate_sc)} (test windows) "
         f"at x{', x'.join(map(str, cfg.data.gate_loads))}, {cfg.data.gate_seeds} seeds")
    uri = loader.tracking_uri(run_dir, cfg.mlflow.tracking_uri)
    exp_id = registry.setup(uri, cfg.mlflow.experiment, run_dir)
    echo(f"MLflow: {uri} (experiment '{cfg.mlflow.experiment}')")
    echo("baselines on the selection windows ...")
    sel = selection_windows(selection, cfg.data.selection_loads, cap, cfg.data.selection_seeds, miss, echo=echo)
    out_dir = run_dir / "planner_trials" / stamp
    points = [{"seed": s, "scorer": sc} for s in cfg.trials.seeds for sc in cfg.trials.scorers]
    with mlflow.start_run(experiment_id=exp_id, run_name=f"train-planner-{stamp}",
                          tags={"xroute.bundle_hash": bundle_hash}) as parent:
        mlflow.log_params({"bundles": bundle_hash[:490], "train": ",".join(s.label for s in train),
                           "selection": ",".join(w.label for w in sel), "gate": ",".join(s.label for s in gate_sc)})
        mlflow.log_dict(cfg.model_dump(mode="json"), "planner_config.json")
        mlflow.log_text(_selection_baselines(sel), "baselines_selection.md")
        with _ray(cfg, ray_address, use_ray):
            need_labels = "network" in cfg.trials.scorers and cfg.labels.episodes > 0
            episodes = sample_episodes(Worlds(train, cfg.data.loads, cap), cfg.labels.episodes,
                                       cfg.labels.episode_epochs, np.random.default_rng(cfg.seed)) if need_labels else []
            echo(f"labels: the hindsight oracle on {len(episodes)} training episodes ...")
            labels = _labels(train, cfg, cap, episodes, use_ray)
            lab = {"states": len(labels), "rows": int(labels.off[-1]), "risk_rows": int(labels.risk_w.sum()),
                   "risk_positive": float((labels.risk * labels.risk_w).sum() / max(labels.risk_w.sum(), 1.0)),
                   "seconds": round(labels.seconds, 1)}
            mlflow.log_dict(lab, "labels.json")
            echo(f"labels: {lab['states']} states, {lab['rows']} pool rows ({lab['risk_rows']} spot rows with an outcome, "
                 f"{100 * lab['risk_positive']:.0f} % preempted within {cfg.labels.risk_epochs} epochs)")
            ctx = PlannerTrialContext(cfg=cfg, cap=cap, train=train, selection=sel, labels=labels, out_dir=str(out_dir),
                                      tracking_uri=uri, experiment_id=exp_id, parent_run_id=parent.info.run_id,
                                      bundle_hash=bundle_hash)
            echo(f"{len(points)} trials (seeds x scorers), at most {cfg.ray.max_concurrent_trials} at a time")
            if use_ray:
                trials = _tune(cfg, ctx, points, run_dir / "tune", f"train-planner-{stamp}", echo)
            else:
                trials = [run_trial(p, ctx) for p in points]
        best = min(trials, key=lambda t: (t["criterion"], t["trial"]))
        other = [t for t in trials if t["scorer"] != best["scorer"]]
        ablation_trial = min(other, key=lambda t: (t["criterion"], t["trial"])) if other else None
        ablation_name = WITHOUT_NETWORK if best["scorer"] == "network" else WITH_NETWORK
        echo(f"best trial: {best['trial']} (selection criterion {best['criterion']:+.4f}; {best['variant']})")
        candidates = {CHALLENGER: read_planner(best["planner_dir"])}
        if ablation_trial is not None:
            echo(f"ablation: {ablation_trial['trial']} ({ablation_name}; selection criterion "
                 f"{ablation_trial['criterion']:+.4f})")
            candidates[ablation_name] = read_planner(ablation_trial["planner_dir"])
        gate_runs = evaluate_gate(gate_sc, cfg.data.gate_loads, candidates, cap, cfg.data.gate_seeds, miss, echo)
        decision = decide(gate_runs, CHALLENGER)
        ablation = decide(gate_runs, ablation_name) if ablation_trial is not None else None
        echo(f"gate: {'PASSED' if decision.passed else 'refused'}: {decision.reason}")
        table = markdown(gate_runs, list(candidates))
        _log_gate(gate_runs, list(candidates), table, decision, ablation, out_dir, cfg.data.gate_seeds)
        mlflow.log_dict({"trials": trials}, "trials.json")
    model_uri, version = _register(cfg, best, decision, ablation, gate_sc[0], cap, uri, echo)
    return PlannerTrainSummary(best, trials, gate_runs, decision, ablation, version, model_uri, uri,
                               time.perf_counter() - t_start, lab)


def _selection_baselines(sel: list[SelectionWindow]) -> str:
    names = list(sel[0].baselines) if sel else []
    rows = ["| window | " + " | ".join(names) + " | best |", "|---|" + "---:|" * (len(names) + 1)]
    for w in sel:
        rows.append(f"| {w.label} | " + " | ".join(f"{np.mean(w.baselines[n]):.4f}" for n in names) + f" | {w.best} |")
    return "penalized held cost, USD per 1k requests (mean over the seeds)\n\n" + "\n".join(rows) + "\n"


def _log_gate(runs: list[WindowResult], names: list[str], table: str, decision: Any, ablation: Any, out_dir: Path,
              seeds: int) -> None:
    from models import capacity_eval as ce

    out_dir.mkdir(parents=True, exist_ok=True)
    mlflow.log_text(table, "gate.md")
    for r in runs:
        mlflow.log_text(ce.markdown_table(r.results), f"gate/{r.label.replace(' ', '_')}.md")
    png = out_dir / "gate.png"
    plot(runs, names, png, title=f"gate: held cost over the best baseline's, test windows, {seeds} seeds")
    mlflow.log_artifact(str(png), "gate")
    m, lo, hi = decision.pooled
    mlflow.log_metrics({"gate_cost_ratio": m, "gate_cost_ratio_hi": hi, "gate_passed": float(decision.passed),
                        **({"ablation_gate_cost_ratio": ablation.pooled[0]} if ablation is not None else {})})


def input_example(sc: Scenario, cap: CapacityConfig, weights: PlannerWeights) -> pd.DataFrame:
    """The model's input example: the first plan of ``weights`` on window ``sc``."""
    from envs.provisioning import ProvisionWorld
    from models.planner_policy import LearnedPlanner
    from models.planner_pyfunc import example_row

    w = ProvisionWorld(sc.bundle, cap.world, history=sc.history)
    lp = LearnedPlanner(cap.planners, weights)
    lp.reset(w.reset(seed=0))
    v = w.view()
    st = lp.step(v)
    return pd.DataFrame([example_row(st, v, w.pools, w.R)])


def log_planner_model(planner_dir: str | Path, example: pd.DataFrame, name: str = "planner") -> Any:
    """Log an exported planner as a pyfunc model in the active run (``models.planner_pyfunc``)."""
    from models.planner_pyfunc import (
        ARTIFACT_KEY,
        INFERENCE_MODULES,
        MODEL_CODE,
        REQUIREMENTS,
        predict_frame,
        signature,
    )
    from models.pyfunc import pip_requirements, stage_code

    predict_frame(read_planner(planner_dir), example)
    with tempfile.TemporaryDirectory(prefix="xroute-planner-code-") as staging:
        return mlflow.pyfunc.log_model(name=name, python_model=str(MODEL_CODE), artifacts={ARTIFACT_KEY: str(planner_dir)},
                                       code_paths=stage_code(staging, INFERENCE_MODULES), signature=signature(),
                                       input_example=example, pip_requirements=pip_requirements(REQUIREMENTS))


def _register(cfg: PlannerTrainConfig, best: dict[str, Any], decision: Any, ablation: Any, sc: Scenario,
              cap: CapacityConfig, uri: str, echo: Callable[[str], None]) -> tuple[str | None, str | None]:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # (its bar when it checks the example)
    mlflow.set_tracking_uri(uri)
    weights = read_planner(best["planner_dir"])
    example = input_example(sc, cap, weights)
    run_id = best.get("mlflow_run_id")
    with mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run():
        info = log_planner_model(best["planner_dir"], example)
    tags = {"trial": best["trial"], "scorer": best["scorer"], "selection_criterion": best["criterion"],
            "variant": best["variant"], **decision.tags("gate"),
            **({k: v for k, v in ablation.tags("ablation_gate").items() if not k.endswith("_reason")}
               if ablation is not None else {}),
            **({"ablation": ablation.candidate} if ablation is not None else {})}
    version = registry.register(info.model_uri, cfg.mlflow.registered_model, registry.CHALLENGER, tags)
    echo(f"registered {cfg.mlflow.registered_model} v{version} -> alias '{registry.CHALLENGER}' "
         f"(models:/{cfg.mlflow.registered_model}@{registry.CHALLENGER})")
    return info.model_uri, version
