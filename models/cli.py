"""``xroute train``, ``xroute train-planner`` and ``xroute promote`` (registered on the app in
``xroute_app/cli.py``).

Plain functions with typer annotations; user errors raise ``XrouteError`` subclasses, which the
``xroute`` entry point prints as one line with exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from xroute.errors import XrouteError


class PromotionRefused(XrouteError):
    """``xroute promote`` declined to move the champion alias (the message says why)."""


def train(
    config: Annotated[Path | None, typer.Option(help="train config YAML (default configs/train.yaml)")] = None,
    telemetry: Annotated[Path | None, typer.Option(help="bundle directory (default: the config's, else the "
                                                        "shipped bundle)")] = None,
    ray_address: Annotated[str | None, typer.Option(help="an existing Ray cluster, HOST:PORT or 'auto' "
                                                         "(default: a new local Ray instance of this run, whatever "
                                                         "cluster the machine or $RAY_ADDRESS names)")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="where Tune results, the MLflow store and exports go "
                                                      "(default: the config's run_dir)")] = None,
    timesteps: Annotated[int | None, typer.Option(help="DQN steps per trial (overrides the config)")] = None,
) -> None:
    """Train the DQN router: Ray Tune trials (seeds x gamma x learning rate) on the training
    bundles' train windows, selection on another bundle's validation window, the promotion gate on
    every bundle's test window; the best registered in MLflow as alias 'challenger'."""
    from models.config import load_train_config

    overrides: dict[str, object] = {}
    if run_dir is not None:
        overrides["run_dir"] = str(run_dir)
    if timesteps is not None:
        overrides["total_timesteps"] = timesteps
    cfg = load_train_config(config, overrides)

    from models import evaluate as ev
    from models.train import CHALLENGER as CHALLENGER_LABEL
    from models.train import WARM_ONLY as WARM_LABEL
    from models.train import run_training

    summary = run_training(cfg, telemetry=telemetry, ray_address=ray_address, echo=typer.echo)
    first = summary.gate[0]
    ev.print_table(first.results, title=f"gate scenario {first.label} (test window)")
    from models import gate

    typer.echo("\nthe gate (test windows no selection saw; Δ = paired difference to the scenario's best baseline, "
               "95 % interval):")
    typer.echo(gate.markdown(summary.gate, [CHALLENGER_LABEL, WARM_LABEL]))
    d = summary.decision
    typer.echo(f"gate {'PASSED' if d.passed else 'REFUSED'}: {d.reason}")
    typer.echo(f"ablation: the warm start alone: pooled Δ reward {gate._fmt(summary.ablation.pooled)}")
    reg = cfg.mlflow.registered_model
    typer.echo(f"model: models:/{reg}@challenger (v{summary.registered_version}); next: xroute promote"
               + ("" if d.passed else " (it will refuse: the gate did not pass)"))
    uri = summary.tracking_uri
    if uri.startswith("sqlite:///"):
        typer.echo(f"MLflow UI: mlflow ui --backend-store-uri {uri} --host 127.0.0.1")
    typer.echo(f"train wall time: {summary.wall_s / 60:.1f} min")


def train_planner(
    config: Annotated[Path | None, typer.Option(help="planner config YAML (default configs/planner.yaml)")] = None,
    telemetry: Annotated[Path | None, typer.Option(help="one bundle directory for training, selection and the gate "
                                                        "(default: the config's bundles)")] = None,
    ray_address: Annotated[str | None, typer.Option(help="an existing Ray cluster, HOST:PORT or 'auto' (default: a "
                                                         "new local Ray instance of this run)")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="where Tune results, the MLflow store and exports go "
                                                      "(default: the config's run_dir)")] = None,
) -> None:
    """Train the learned capacity planner (docs/capacity.md): Ray Tune trials on the training bundles'
    train windows (the oracle's plans and the spot traces' outcomes as labels, then a cost-sensitive
    search of its knobs), selection on validation windows, the gate on test windows no training or
    selection saw; the best registered in MLflow as xroute-planner, alias 'challenger'."""
    from models.config import load_planner_config

    overrides: dict[str, object] = {}
    if run_dir is not None:
        overrides["run_dir"] = str(run_dir)
    cfg = load_planner_config(config, overrides)

    from models import planner_gate
    from models.planner_trainer import CHALLENGER, run_planner_training

    s = run_planner_training(cfg, telemetry=telemetry, ray_address=ray_address, echo=typer.echo)
    names = [CHALLENGER] + ([s.ablation.candidate] if s.ablation is not None else [])
    typer.echo("\nthe gate (test windows no training or selection saw; paired by seed, 95 % intervals):")
    typer.echo(planner_gate.markdown(s.gate, names))
    d = s.decision
    typer.echo(f"gate {'PASSED' if d.passed else 'REFUSED'}: {d.reason}")
    if s.ablation is not None:
        typer.echo(f"ablation: {s.ablation.candidate}: pooled cost x best baseline {planner_gate._fmt(s.ablation.pooled)}")
    reg = cfg.mlflow.registered_model
    typer.echo(f"model: models:/{reg}@challenger (v{s.registered_version}); next: xroute promote --model {reg}"
               + ("" if d.passed else " (it will refuse: the gate did not pass)"))
    if s.tracking_uri.startswith("sqlite:///"):
        typer.echo(f"MLflow UI: mlflow ui --backend-store-uri {s.tracking_uri} --host 127.0.0.1")
    typer.echo(f"train-planner wall time: {s.wall_s / 60:.1f} min")


def promote(
    model: Annotated[str | None, typer.Option(help="registered model name (default: the train config's)")] = None,
    config: Annotated[Path | None, typer.Option(help="train config YAML (for the run dir and model name)")] = None,
    ope: Annotated[Path | None, typer.Option(help="an `xroute ope` report: also require the challenger's OPE lower "
                                                  "bound on the logged traffic to beat the champion's estimate (the "
                                                  "logged mean reward when the report has no champion)")] = None,
    ope_estimator: Annotated[str, typer.Option(help="the estimator --ope compares: dr, snips or ips")] = "dr",
) -> None:
    """Move alias 'champion' to the 'challenger' version if it passed the gate at training: on the
    test windows no selection saw, the lower bound of its paired difference in mean reward to the
    best baseline is above zero and it loses significantly nowhere (and, with --ope, if its
    off-policy estimate on the router's log beats the champion's); otherwise say why and exit
    non-zero."""
    from models import loader, registry
    from models.config import load_train_config

    report = None
    if ope is not None:
        from models.ope import ESTIMATORS, load_report

        if ope_estimator not in ESTIMATORS:
            from xroute.errors import ConfigError

            raise ConfigError(f"--ope-estimator: '{ope_estimator}' is not one of {', '.join(ESTIMATORS)}")
        report = load_report(ope)
    cfg = load_train_config(config)
    name = model or cfg.mlflow.registered_model
    import mlflow

    loader.quiet_mlflow()
    mlflow.set_tracking_uri(loader.tracking_uri(cfg.run_path(), cfg.mlflow.tracking_uri))
    decision = registry.promote(name, ope=report, ope_estimator=ope_estimator, ope_source=str(ope))
    if not decision.promoted:
        raise PromotionRefused(f"promote refused: {decision.reason}")
    typer.echo(f"promoted: {decision.reason}")
