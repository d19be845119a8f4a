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
    sample: Annotated[int | None, typer.Option(help="a quick look: only this many requests, in evenly spaced "
                                               "contiguous blocks of the stream")] = None,
    seeds: Annotated[int | None, typer.Option(help="seeds per policy (default from config: 5); metrics are "
                                              "reported as mean and 95 % interval")] = None,
    rate_scale: Annotated[float, typer.Option(help="compress arrivals: 4 = four times the load")] = 1.0,
    output: Annotated[Path | None, typer.Option(help="JSON report path (default reports/evaluate-<UTC time>.json, "
                                                "never an earlier run's)")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG of the comparison (default: the report's path with .png)")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="write no plot")] = False,
    config: Annotated[Path | None, typer.Option(help="evaluate config YAML (default configs/evaluate.yaml)")] = None,
    seed: Annotated[int | None, typer.Option(help="first seed (default from config)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress")] = False,
) -> None:
    """Replay the same request stream through each policy, for several seeds, and compare them."""
    import pandas as pd

    from xroute import evaluate as ev
    from xroute.bundle import load_bundle
    from xroute.config import EvaluateConfig, config_path, load_config

    if rate_scale <= 0:
        raise ConfigError(f"--rate-scale: must be > 0, got {rate_scale}")
    if seeds is not None and seeds < 1:
        raise ConfigError(f"--seeds: must be at least 1, got {seeds}")
    if sample is not None and sample < 1:
        raise ConfigError(f"--sample: must be at least 1 request, got {sample}")
    cfg_file = config if config is not None else config_path("evaluate.yaml")
    cfg = load_config(EvaluateConfig, cfg_file if Path(cfg_file).exists() or config is not None else None)
    upd: dict[str, object] = {"env": cfg.env.model_copy(update={"rate_scale": rate_scale, "episode_requests": None})}
    if seed is not None:
        upd["seed"] = seed
    if seeds is not None:
        upd["seeds"] = seeds
    cfg = cfg.model_copy(update=upd)
    bundle = load_bundle(telemetry)
    history = None
    if window is not None:
        from models.config import load_train_config
        from models.train import SPLITS, split_bundle

        if window not in SPLITS:
            raise ConfigError(f"--window: '{window}' is not one of {', '.join(SPLITS)}")
        splits = split_bundle(bundle, load_train_config(train_config).split)
        # the routers start from the outputs of the requests before the window (known by then)
        before = [splits.bundles[w].workload for w in SPLITS[: SPLITS.index(window)]]
        history = pd.concat(before, ignore_index=True) if before else None
        bundle = splits.bundles[window]
    bundle = bundle.window(_ts(start, "--start"), _ts(end, "--end"))
    if sample is not None:
        bundle = bundle.select(ev.sample_rows(len(bundle.workload), sample))
    out = output if output is not None else ev.default_report_path()
    results = ev.evaluate(bundle, list(dict.fromkeys(policy)), cfg, show_progress=not quiet, history=history)
    span = bundle.time_span()
    end_fmt = "%H:%M" if span[0].date() == span[1].date() else "%Y-%m-%d %H:%M"
    what = f"{len(bundle.workload)} requests" + (f" (sample of {sample})" if sample is not None else "")
    ev.print_table(results, title=f"xroute evaluate — {bundle.path.name}, {what}, "
                                  f"{span[0]:%Y-%m-%d %H:%M}–{span[1].strftime(end_fmt)} UTC, rate x{rate_scale:g}")
    ev.write_json(ev.report_dict(results, bundle, cfg, {"start": str(span[0]), "end": str(span[1]),
                                                       "sample": sample, "window": window}), out)
    typer.echo(f"report: {out}")
    if not no_plot:
        png = plot if plot is not None else out.with_suffix(".png")
        ev.plot(results, png, title=f"{bundle.path.name}, {what}, rate x{rate_scale:g}, {cfg.seeds} seed(s)")
        typer.echo(f"plot: {png}")


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
