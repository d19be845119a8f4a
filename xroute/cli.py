"""The ``xroute`` command line. Every user error ends in one readable line and exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from cloud_adapters.cli import telemetry_app
from models.cli import promote, train
from router.cli import export_feedback, serve
from xroute.errors import ConfigError, XrouteError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="xroute: reinforcement-learning cross-cloud router.")


@app.callback()
def _root() -> None:
    """xroute: reinforcement-learning cross-cloud router."""


def _ts(value: str | None, option: str) -> str | None:
    if value is None:
        return None
    import pandas as pd

    try:
        pd.Timestamp(value)
    except (ValueError, TypeError):
        raise ConfigError(f"{option}: '{value}' is not an ISO-8601 timestamp (e.g. 2023-11-16T18:30:00Z)") from None
    return value


@app.command()
def evaluate(
    policy: Annotated[list[str], typer.Option("--policy", "-p", help="policy name (repeatable): static, "
                                              "static:OFFERING_ID, cheapest, lowest-latency, least-loaded, greedy, "
                                              "round-robin, random, oracle, models:/NAME@ALIAS or a model path")],
    telemetry: Annotated[Path | None, typer.Option(help="bundle directory (default: the shipped bundle)")] = None,
    start: Annotated[str | None, typer.Option(help="first request time (ISO-8601, inclusive)")] = None,
    end: Annotated[str | None, typer.Option(help="last request time (ISO-8601, exclusive)")] = None,
    window: Annotated[str | None, typer.Option(help="train | validation | test: the time split `xroute train` "
                                               "uses (fractions from --train-config)")] = None,
    train_config: Annotated[Path | None, typer.Option(help="train config YAML for --window "
                                                      "(default configs/train.yaml)")] = None,
    rate_scale: Annotated[float, typer.Option(help="compress arrivals: 4 = four times the load")] = 1.0,
    output: Annotated[Path, typer.Option(help="JSON report path")] = Path("reports/evaluate.json"),
    plot: Annotated[Path | None, typer.Option(help="PNG: cost vs p95 per policy, cumulative cost")] = None,
    config: Annotated[Path | None, typer.Option(help="evaluate config YAML (default configs/evaluate.yaml)")] = None,
    seed: Annotated[int | None, typer.Option(help="seed (default from config)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Replay the same request stream through each policy and compare them."""
    from xroute import evaluate as ev
    from xroute.bundle import load_bundle
    from xroute.config import EvaluateConfig, config_path, load_config

    if rate_scale <= 0:
        raise ConfigError(f"--rate-scale: must be > 0, got {rate_scale}")
    cfg_file = config if config is not None else config_path("evaluate.yaml")
    cfg = load_config(EvaluateConfig, cfg_file if Path(cfg_file).exists() or config is not None else None)
    cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"rate_scale": rate_scale, "episode_requests": None}),
                                 **({"seed": seed} if seed is not None else {})})
    bundle = load_bundle(telemetry)
    if window is not None:
        from models.config import load_train_config
        from models.train import SPLITS, split_bundle

        if window not in SPLITS:
            raise ConfigError(f"--window: '{window}' is not one of {', '.join(SPLITS)}")
        bundle = split_bundle(bundle, load_train_config(train_config).split).bundles[window]
    bundle = bundle.window(_ts(start, "--start"), _ts(end, "--end"))
    runs = ev.evaluate(bundle, list(dict.fromkeys(policy)), cfg, show_progress=not quiet)
    span = bundle.time_span()
    ev.print_table(runs, title=f"xroute evaluate — {bundle.path.name}, {len(bundle.workload)} requests, "
                               f"{span[0]:%Y-%m-%d %H:%M}–{span[1]:%H:%M} UTC, rate x{rate_scale:g}")
    ev.write_json(ev.report_dict(runs, bundle, cfg, {"start": str(span[0]), "end": str(span[1])}), output)
    typer.echo(f"report: {output}")
    if plot is not None:
        ev.plot(runs, plot, title=f"{bundle.path.name}, rate x{rate_scale:g}")
        typer.echo(f"plot: {plot}")


# commands owned by the other packages (their modules import only typer at top level)
app.command()(train)
app.command()(promote)
app.command()(serve)
app.command(name="export-feedback")(export_feedback)
app.add_typer(telemetry_app, name="telemetry", help="Collect telemetry from cloud accounts into a bundle.")


def main() -> None:
    try:
        app()
    except XrouteError as e:
        typer.echo(f"xroute: error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("xroute: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
