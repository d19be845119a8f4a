"""``xroute telemetry ...``: the collector's command line (a typer sub-app, mounted by ``xroute_app/cli.py``).

    xroute telemetry collect --providers aws,azure,gcp --regions us-east-1,eastus,us-central1 \\
        --out telemetry/ --every 10m
    xroute telemetry capabilities
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from xroute.errors import ConfigError, XrouteError

telemetry_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                            help="Collect live offerings, prices, spot signals, quotas, utilization and RTT into a bundle.")


def _load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot be read as YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of collector settings")
    return data


def _summary(report: Any, console: Console) -> None:
    rec = report.record
    counts: dict[str, int] = {}
    for s in rec["sources"]:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    console.print(f"[bold]collected[/] in {rec['wall_s']:.2f} s with {sum(rec['calls'].values())} API calls "
                  f"({', '.join(f'{k} {v}' for k, v in sorted(rec['calls'].items()))}); sources: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    added = {k: v for k, v in rec["rows_added"].items() if v}
    console.print("rows added: " + (", ".join(f"{k} {v}" for k, v in added.items()) or "none (nothing changed)"))
    stale = [s for s in rec["sources"] if s["status"] == "stale"]
    if stale:
        t = Table("stale source", "reason", title="kept the last good rows for", title_justify="left")
        for s in stale:
            t.add_row(s["source"], s["reason"])
        console.print(t)
    for h in rec["held_back"]:
        console.print(f"[yellow]held back[/] {h}")


@telemetry_app.command()
def collect(
    regions: Annotated[str, typer.Option(help="comma-separated regions; provider:region, or a plain name that "
                                         "only one provider uses (us-east-1, eastus, us-central1)")],
    out: Annotated[Path, typer.Option(help="bundle directory to append to (created if missing)")],
    providers: Annotated[str, typer.Option(help="comma-separated providers")] = "aws,azure,gcp",
    every: Annotated[str | None, typer.Option(help="repeat every DURATION (30s, 10m, 1h) until Ctrl-C")] = None,
    max_runs: Annotated[int | None, typer.Option(help="with --every: stop after N runs")] = None,
    origin: Annotated[str | None, typer.Option(help="location id of this machine: the src of RTT rows "
                                               "(default 'local')")] = None,
    deadline: Annotated[str | None, typer.Option(help="time limit of one run (default 5m)")] = None,
    concurrency: Annotated[int | None, typer.Option(help="regions collected at once (default 8)")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML with more settings: pools, provider_options, "
                                                "rtt_targets, spot_history_hours, ...")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress display")] = False,
) -> None:
    """Collect one snapshot (or one every --every) from the providers into the bundle at --out."""
    from cloud_adapters.collect.config import CollectConfig, assign_regions, parse_duration
    from cloud_adapters.collect.schedule import collect_every

    console = Console(stderr=True, quiet=quiet)
    try:
        settings = _load_config(config)
        plist = [p.strip() for p in providers.split(",") if p.strip()]
        settings.update(providers=plist, regions=assign_regions(plist, regions.split(",")), out=out)
        if origin is not None:
            settings["origin"] = origin
        if deadline is not None:
            settings["deadline_s"] = parse_duration(deadline)
        if concurrency is not None:
            settings["concurrency"] = concurrency
        try:
            cfg = CollectConfig(**settings)
        except Exception as e:  # pydantic's ValidationError names the field
            raise ConfigError(f"collector settings: {e}") from e
        every_s = parse_duration(every) if every else None
        outcome: dict[str, bool] = {"any_ok": False}

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True, disable=quiet)
        state: dict[str, Any] = {}

        def on_event(kind: str, task: str, detail: str) -> None:
            if kind == "plan":
                state["task"] = progress.add_task(f"collecting into {out}", total=int(detail))
            elif kind == "done" and "task" in state:
                progress.update(state["task"], advance=1, description=f"{task}: {detail}")

        def on_report(report: Any) -> None:
            if "task" in state:
                progress.remove_task(state.pop("task"))
            outcome["any_ok"] = outcome["any_ok"] or report.any_ok
            _summary(report, console)

        def on_error(e: Exception) -> None:
            if "task" in state:
                progress.remove_task(state.pop("task"))
            console.print(f"run failed: {e}", markup=False)

        stop = threading.Event()
        with progress:
            try:
                collect_every(cfg, every_s or 0.0, max_runs=1 if every_s is None else max_runs,
                              on_report=on_report, on_event=on_event, on_error=on_error, stop=stop)
            except KeyboardInterrupt:
                stop.set()
                console.print("stopped (the bundle holds the last completed run)")
        if not outcome["any_ok"]:
            console.print("[red]no source answered[/]; see collect_log.json in the bundle directory")
            raise typer.Exit(1)
    except XrouteError as e:
        console.print(f"error: {e}", markup=False)
        raise typer.Exit(2) from e


@telemetry_app.command()
def capabilities(
    providers: Annotated[str, typer.Option(help="comma-separated providers")] = "aws,azure,gcp,prometheus",
) -> None:
    """What each provider's adapter can collect, and why not where it cannot (no network calls)."""
    from cloud_adapters import registry

    console = Console()
    try:
        t = Table("provider", "feature", "supported", "why not")
        for name in (p.strip() for p in providers.split(",") if p.strip()):
            for f, reason in registry.get_adapter(name).capabilities().items():
                t.add_row(name, f.value, "yes" if reason is None else "no", reason or "")
        console.print(t)
    except XrouteError as e:
        console.print(f"error: {e}", markup=False)
        raise typer.Exit(2) from e


events_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                         help="Preemption notices from an instance's metadata service to the router.")


@events_app.command("watch")
def events_watch(
    cloud: Annotated[str, typer.Option(help="the instance's cloud: aws, azure or gcp (which metadata service)")],
    pool: Annotated[str, typer.Option(help="the offering this instance serves (GET /v1/offerings)")],
    router: Annotated[str, typer.Option(help="the router's base URL, e.g. http://xroute.internal:8000")],
    key_env: Annotated[str, typer.Option(help="the environment variable holding an events (or admin) key")]
    = "XROUTE_EVENTS_KEY",
    every: Annotated[float, typer.Option(help="seconds between polls", min=0.1)] = 5.0,
    once: Annotated[bool, typer.Option(help="poll once and exit")] = False,
    metadata_url: Annotated[str | None, typer.Option(help="the metadata service's base URL (default: the "
                                                     "cloud's link-local address)")] = None,
) -> None:
    """Poll this instance's metadata service and post each preemption or rebalance notice to the
    router as a pool event for --pool (docs/migration.md, "Watching the clouds")."""
    import os

    from cloud_adapters.watch import watch

    key = os.environ.get(key_env, "").strip()
    if not key:
        raise ConfigError(f"--key-env: the environment variable '{key_env}' is not set (an events key: "
                          f"xroute serve's keys file, role 'events')")
    try:
        watch(cloud, pool, router, key, every_s=every, once=once, metadata_url=metadata_url,
              log=lambda line: typer.echo(line, err=True))
    except KeyboardInterrupt:
        typer.echo("stopped", err=True)
