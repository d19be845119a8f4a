"""``xroute serve``, ``xroute export-feedback`` and ``xroute export-ope`` (registered in ``xroute_app/cli.py``).

Imports stay inside the functions: ``xroute --help`` must not pay for FastAPI, numpy or the env.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def serve(
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    telemetry: Annotated[Path | None, typer.Option(help="telemetry bundle directory (default: the shipped one)")] = None,
    live: Annotated[bool | None, typer.Option("--live/--replay", help="serve --telemetry live: a directory "
                                              "'xroute telemetry collect' keeps current, on the wall clock "
                                              "(default: replay a recorded bundle)")] = None,
    config: Annotated[Path | None, typer.Option(help="router config YAML (default: configs/router.yaml if present)")] = None,
    model: Annotated[str | None, typer.Option(help="model URI or path (default models:/xroute-router@champion); "
                                                   "'' = fallback only")] = None,
    fallback: Annotated[str | None, typer.Option(help="baseline used without a model (default greedy)")] = None,
    db: Annotated[str | None, typer.Option(help="decision log: a SQLite file (default runs/router/decisions.db) "
                                            "or a postgresql://user@host:port/dbname URL (password from "
                                            "PGPASSWORD / PGPASSFILE / ~/.pgpass)")] = None,
    keys_file: Annotated[Path | None, typer.Option(help="API keys file (default runs/router/keys.json)")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING")] = None,
    workers: Annotated[int, typer.Option(help="worker processes on one port; more than one needs "
                                              "state_backend: redis (they share its view)")] = 1,
) -> None:
    """Serve the routing API over HTTP (see docs/router.md)."""
    from router.core.startup import hold_gc, release_gc

    hold_gc()  # until the app's lifespan has started (router.core.startup)
    try:
        _serve(host, port, telemetry, live, config, model, fallback, db, keys_file, log_level, workers)
    finally:
        release_gc(only_if_held=True)  # (a start that failed before the app's lifespan ended it)


def _serve(host: str, port: int, telemetry: Path | None, live: bool | None, config: Path | None, model: str | None,
           fallback: str | None, db: str | None, keys_file: Path | None, log_level: str | None, workers: int) -> None:
    import os

    import uvicorn

    if workers == 1:  # (the supervisor of several builds no app: its workers do, router.app.worker)
        from router.app.factory import create_app
    from router.core.settings import load_settings
    from router.core.startup import CLOCK, freeze_imports, release_gc, settle_gc
    from router.decision.engine import RoutingEngine
    from router.gateway.service import check_settings
    from router.store.dialect import is_postgres_url
    from xroute.errors import ConfigError

    freeze_imports()
    CLOCK.mark("imports")
    if not 1 <= workers <= 256:
        raise ConfigError(f"--workers: must be from 1 to 256, got {workers}")
    pg = db is not None and is_postgres_url(db)
    options = {"telemetry": telemetry, "telemetry_live": live, "model_uri": model, "fallback_policy": fallback,
               "db_path": None if pg or db is None else Path(db), "db_url": db if pg else None,
               "keys_file": keys_file, "log_level": log_level}
    settings = load_settings(config, **options)
    CLOCK.mark("settings")
    if workers > 1 and settings.state_backend == "embedded":
        raise ConfigError(f"--workers {workers}: the embedded state lives in one process, so each worker would see "
                          "only its own decisions and could overfill the pools; set state_backend: redis with a "
                          "state_url (XROUTE_ROUTER_STATE_BACKEND=redis XROUTE_ROUTER_STATE_URL=redis://host:port/0), "
                          "or serve one worker")
    engine = RoutingEngine(settings)  # bad telemetry or config fails here, as one line, before listening
    check_settings(settings, engine)  # so do the gateway's upstreams, their keys and tokenizers
    if settings.policy_files:  # so does a bad policy file
        from router.control.policy_sync import read_policy_files

        read_policy_files(settings.policy_files, engine.check_policies)
    if settings.db_url is not None:  # so does a PostgreSQL log that cannot be reached
        from router.store.postgres import check_reachable

        check_reachable(settings.db_url.get_secret_value())
    CLOCK.mark("checks")
    serving = {"host": host, "port": port, "log_config": None, "access_log": False, "timeout_graceful_shutdown": 10,
               "server_header": False}
    if workers == 1:
        uvicorn.run(create_app(settings, engine), workers=1, **serving)  # type: ignore[arg-type]
        return
    # several workers: each builds the app from the config file and the environment, so this
    # command's options go to them as the environment variables they override
    del engine
    settle_gc()  # (the supervisor runs no lifespan of its own: its engine collected, the collector back on)
    release_gc()
    from router.app.lifeline import SUPERVISOR_ENV
    from router.core.logs import configure_logging

    configure_logging(settings.log_level)  # the supervisor's own lines (uvicorn's) as JSON too
    os.environ[SUPERVISOR_ENV] = str(os.getpid())  # its workers die with it, even after a SIGKILL
    if config is not None:
        os.environ["XROUTE_ROUTER_CONFIG"] = str(config)
    for field, value in options.items():
        if value is not None:
            os.environ[f"XROUTE_ROUTER_{field.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    uvicorn.run("router.app.worker:app", factory=True, workers=workers, **serving)  # type: ignore[arg-type]


def export_feedback(
    output: Annotated[Path, typer.Option(help="bundle directory to write")],
    db: Annotated[str | None, typer.Option(help="decision log: a SQLite file or a postgresql:// URL (default: the "
                                            "router's db_url, else db_path setting)")] = None,
    telemetry: Annotated[Path | None, typer.Option(help="bundle the decisions were made on "
                                                        "(default: the router's telemetry setting)")] = None,
    config: Annotated[Path | None, typer.Option(help="router config YAML")] = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's decisions")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace a non-empty output directory")] = False,
) -> None:
    """Write decisions and their observed outcomes as a telemetry bundle, for retraining."""
    from router.core.settings import load_settings
    from router.service.export import export_bundle

    settings = load_settings(config)
    source: Path | str = db if db is not None else settings.log_target
    out = export_bundle(source, telemetry or settings.telemetry, output, tenant, overwrite)
    typer.echo(f"exported {out['decisions']} decisions ({out['with_feedback']} with feedback) to {out['output']}"
               + (f"; skipped {out['skipped_other_bundle']} made on another bundle" if out["skipped_other_bundle"] else ""))


def _wall_time(option: str, value: str | None) -> float | None:
    """An ISO-8601 time (UTC unless it names its offset) as epoch seconds."""
    if value is None:
        return None
    from datetime import UTC, datetime

    from xroute.errors import ConfigError

    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"{option}: '{value}' is not an ISO-8601 time (e.g. 2026-01-31T12:00:00Z)") from None
    return (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).timestamp()


def export_ope(
    output: Annotated[Path, typer.Option(help="the log to write: *.parquet, *.jsonl or *.jsonl.gz (docs/ope.md)")],
    db: Annotated[str | None, typer.Option(help="decision log: a SQLite file or a postgresql:// URL (default: the "
                                            "router's db_url, else db_path setting)")] = None,
    config: Annotated[Path | None, typer.Option(help="router config YAML (its env config names the reward)")] = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's decisions")] = None,
    since: Annotated[str | None, typer.Option(help="only decisions made at or after this time (ISO-8601, UTC "
                                               "unless it says)")] = None,
    until: Annotated[str | None, typer.Option(help="only decisions made before this time")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output file")] = False,
) -> None:
    """Write the decisions that have feedback as a decision log for off-policy evaluation: each with
    the offerings it chose among, the features its policy saw, its propensity and its reward; then
    `xroute ope --log OUTPUT --policy ...`."""
    from router.core.settings import load_settings
    from router.decision.engine import env_config
    from router.service.export import export_ope as write

    settings = load_settings(config)
    source: Path | str = db if db is not None else settings.log_target
    out = write(source, output, env_config(settings), tenant, _wall_time("--since", since),
                _wall_time("--until", until), overwrite)
    typer.echo(f"exported {out['decisions']} decisions to {out['output']}; left out: {out['left_out']}")
