"""``xroute capacity apply``: a capacity plan made real through the cloud adapters -- dry run unless
``--apply`` (``docs/capacity.md``, "Actuation and its safety limits").

    xroute capacity apply --plan plan.json --telemetry telemetry/ --config actuate.yaml            # dry run
    xroute capacity apply --plan plan.json --telemetry telemetry/ --config actuate.yaml --apply    # changes

The wiring lives here because it joins two layers the contract keeps apart (``docs/architecture.md``):
the checks, the steps and the cloud calls are ``cloud_adapters.actuate`` (which may import only
``xroute``), the journal is the router's audit log (``router.store.capacity``); ``xroute_app`` may
import both.

``--config`` is YAML with ``provider_options`` (each adapter's settings, its ``groups`` -- the pool ->
group mapping -- among them, as in ``xroute telemetry collect --config``) and ``limits``
(``xroute.schema.capacity.ActuationLimits``: ``max_usd_per_hour``, ``max_step``); unknown keys are
errors. ``--max-usd-per-hour`` and ``--max-step`` override the file. Every refusal is one line
naming the field, exit 2, nothing changed; a change that failed at the cloud exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

capacity_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                           help="Capacity actuation: a plan's targets set on the cloud groups (dry run by default).")


def _pydantic_line(e: Exception, prefix: str = "") -> str:
    """A pydantic ValidationError's first problem as ``field: problem``."""
    errs = getattr(e, "errors", None)
    if not callable(errs):
        return f"{prefix.rstrip('.')}: {e}" if prefix else str(e)
    first = errs()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    if msg.startswith("groups["):  # our validators name the field themselves
        return f"{prefix}{msg}"
    got = first.get("input")
    shown = "" if first.get("type") == "missing" or isinstance(got, dict | list) else f" (got {got!r})"
    return f"{prefix}{loc}: {msg}{shown}"


def _config(path: Path | None) -> dict[str, Any]:
    import yaml

    from xroute.errors import ConfigError

    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot be read as YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping with provider_options and limits")
    unknown = sorted(set(data) - {"provider_options", "limits"})
    if unknown:
        raise ConfigError(f"--config {path}: {unknown[0]}: unknown key (known: provider_options, limits)")
    return data


def _limits(data: dict[str, Any], max_usd_per_hour: float | None, max_step: int | None, dry_run: bool) -> Any:
    from pydantic import ValidationError

    from xroute.errors import ConfigError
    from xroute.schema.capacity import ActuationLimits

    raw = dict(data.get("limits") or {})
    if max_usd_per_hour is not None:
        raw["max_usd_per_hour"] = max_usd_per_hour
    if max_step is not None:
        raw["max_step"] = max_step
    raw["dry_run"] = dry_run
    for name, flag, what in (("max_usd_per_hour", "--max-usd-per-hour", "the most the held instances may cost per "
                              "hour, all pools"), ("max_step", "--max-step", "the most instances a pool may change by "
                                                   "in one apply")):
        if raw.get(name) is None:
            raise ConfigError(f"{name}: required ({what}): {flag} or limits.{name} in --config")
    try:
        return ActuationLimits(**raw)
    except ValidationError as e:
        raise ConfigError(_pydantic_line(e)) from None


def _plan(path: Path) -> Any:
    from pydantic import ValidationError

    from xroute.errors import ConfigError
    from xroute.schema.capacity import CapacityPlan

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--plan {path}: cannot be read ({e.strerror or e})") from None
    try:
        return CapacityPlan.model_validate_json(text)
    except ValidationError as e:
        raise ConfigError(_pydantic_line(e, f"--plan {path}: ")) from None


def _adapters(plan: Any, options: dict[str, Any]) -> dict[str, Any]:
    """An adapter per provider the plan names, with its settings (their errors naming the field)."""
    from pydantic import ValidationError

    from cloud_adapters import registry
    from xroute.errors import ConfigError

    out = {}
    for provider in sorted({p.offering_id.split(":", 1)[0] for p in plan.pools}):
        if provider not in registry.cloud_names():
            i = next(i for i, p in enumerate(plan.pools) if p.offering_id.split(":", 1)[0] == provider)
            raise ConfigError(f"pools[{i}].offering_id: '{plan.pools[i].offering_id}' names no cloud provider "
                              f"({', '.join(registry.cloud_names())})")
        try:
            out[provider] = registry.get_adapter(provider, (options or {}).get(provider))
        except ValidationError as e:
            raise ConfigError(_pydantic_line(e, f"provider_options.{provider}.")) from None
    return out


@capacity_app.command("apply")
def apply(
    plan: Annotated[Path, typer.Option(help="the capacity plan (JSON: xroute plan's output)")],
    telemetry: Annotated[Path, typer.Option(help="the collector's bundle directory: its quotas, prices and "
                                            "offerings bound the plan")],
    config: Annotated[Path | None, typer.Option(help="YAML: provider_options (with each provider's groups) and "
                                                "limits (max_usd_per_hour, max_step)")] = None,
    max_usd_per_hour: Annotated[float | None, typer.Option(help="the most the plan's instances may cost per hour "
                                                           "(required, here or in --config)")] = None,
    max_step: Annotated[int | None, typer.Option(help="the most instances a pool may change by in one apply "
                                                 "(required, here or in --config)")] = None,
    do_apply: Annotated[bool, typer.Option("--apply", help="make the changes (default: a dry run that changes "
                                           "nothing)")] = False,
    db: Annotated[str | None, typer.Option(help="the audit log the changes are journaled in: the router's decision "
                                           "log, a SQLite file or a postgresql:// URL (default: the router config's "
                                           "db_url, else db_path)")] = None,
    router_config: Annotated[Path | None, typer.Option(help="router config YAML (for the default --db)")] = None,
) -> None:
    """Set each pool's group toward the plan's target, within the quotas, the USD/hour limit and the
    step limit; dry run unless --apply. Every change is journaled in the audit log (kind capacity)
    before it is made, so a killed run, rerun, changes nothing twice."""
    from cloud_adapters.actuate import Telemetry, apply_steps, plan_steps
    from cloud_adapters.collect.commit import read_tables
    from router.control.policy_sync import cli_principal
    from router.core.settings import load_settings
    from router.store.capacity import CapacityJournal
    from router.store.dialect import is_postgres_url
    from xroute.errors import ConfigError

    data = _config(config)
    limits = _limits(data, max_usd_per_hour, max_step, dry_run=not do_apply)
    the_plan = _plan(plan)
    if not telemetry.is_dir():
        raise ConfigError(f"--telemetry: {telemetry} is not a directory (the collector's bundle)")
    adapters = _adapters(the_plan, data.get("provider_options") or {})
    steps = plan_steps(the_plan, limits, adapters, Telemetry.from_tables(read_tables(telemetry)))

    target = db if db is not None else load_settings(router_config).log_target
    journal = None
    if do_apply or is_postgres_url(target) or Path(target).exists():  # a dry run creates no log
        journal = CapacityJournal(target, cli_principal())
    try:
        results = apply_steps(steps, adapters, journal, dry_run=not do_apply,
                              reason=f"plan {the_plan.at.isoformat()} by {the_plan.planner}",
                              on_result=lambda r: typer.echo(
                                  f"{r.step.label}: {r.step.before} -> {r.after} (target {r.step.target}): "
                                  f"{r.outcome}{': ' + r.detail if r.detail else ''}"))
    finally:
        if journal is not None:
            journal.close()
    if not do_apply:
        n = sum(r.outcome == "would change" for r in results)
        typer.echo(f"dry run: nothing changed ({n} change(s) would be made); --apply to make them")
    failed = [r for r in results if r.outcome == "failed"]
    if failed:
        typer.echo(f"{len(failed)} change(s) failed; rerun to retry them (the journal keeps what was made)", err=True)
        raise typer.Exit(1)
