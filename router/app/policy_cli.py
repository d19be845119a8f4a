"""``xroute policies``: validate policy files, apply them to a router's policy store, show the set
in force, read the audit log, export the set as Rego plus data for OPA (docs/policies.md).

Imports stay inside the functions: ``xroute --help`` must not pay for the env or the store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

policies_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                           help="Routing policies: validate, apply, show, audit, export to Rego (docs/policies.md).")

PoliciesOpt = Annotated[list[Path] | None, typer.Option(
    "--policies", help="policy YAML file or directory (repeatable)")]
DbOpt = Annotated[str | None, typer.Option(help="the router's decision log, where its policy store lives: a SQLite "
                                                "file or a postgresql:// URL (default: the router config's db_url, "
                                                "else db_path)")]
ConfigOpt = Annotated[Path | None, typer.Option(help="router config YAML")]


def _store_target(db: str | None, config: Path | None) -> Path | str:
    from router.core.settings import load_settings

    return db if db is not None else load_settings(config).log_target


def _check_against(telemetry: Path | None):  # type: ignore[no-untyped-def]
    """A check of a policy set against a bundle's catalog and models (``RoutingEngine.check_policies``
    without a router)."""
    from envs.cloud_route import CloudRouteEnv
    from xroute.config import EnvConfig
    from xroute.schema.policy_ir import PolicyCatalog, check_policy_set

    env = CloudRouteEnv(None if telemetry is None else str(telemetry), EnvConfig(episode_requests=1), all_models=True)
    cat = PolicyCatalog(env.catalog, env.model_names, env.origins)
    return lambda ps, prefix="": check_policy_set(ps, cat, prefix)


@policies_app.command()
def validate(policies: PoliciesOpt = None,
             telemetry: Annotated[Path | None, typer.Option(help="bundle whose catalog the values are checked "
                                                                 "against (default: the shipped bundle)")] = None
             ) -> None:
    """Check policy files: the schema (unknown keys, types, references) and every value against a
    catalog. One line per error naming the file and the field; exit 2 on the first."""
    from xroute.config import load_policies
    from xroute.errors import ConfigError
    from xroute.schema.policy_ir import ConstraintError

    paths = _need(policies)
    ps = load_policies(*paths)
    try:
        _check_against(telemetry)(ps, "")
    except ConstraintError as e:
        raise ConfigError(f"{', '.join(map(str, paths))}: {e}") from None
    typer.echo(f"ok: {len(ps.policies)} policies, {len(ps.region_sets)} region sets, {len(ps.slo_tiers)} SLO tiers")


def _need(policies: list[Path] | None) -> list[Path]:
    from xroute.errors import ConfigError

    if not policies:
        raise ConfigError("--policies: give a policy YAML file or directory")
    return policies


@policies_app.command()
def apply(policies: PoliciesOpt = None, db: DbOpt = None, config: ConfigOpt = None,
          telemetry: Annotated[Path | None, typer.Option(help="bundle whose catalog the values are checked "
                                                              "against (default: the router config's telemetry)")
                               ] = None) -> None:
    """Apply policy files to a policy store, as a router applies its policy_files at start: their
    policies replace those of the same names, the ones an earlier apply defined and the files no
    longer do are deleted; audited as cli:<user>. Routers pick the new version up within
    policy_poll_s."""
    from router.control.policy_sync import apply_policy_files, cli_principal
    from router.core.settings import load_settings
    from router.store.policies import PolicyStore

    paths = _need(policies)
    if telemetry is None and db is None:
        telemetry = load_settings(config).telemetry
    store = PolicyStore(_store_target(db, config))
    try:
        new = apply_policy_files(store, paths, cli_principal(), _check_against(telemetry))
    finally:
        store.close()
    typer.echo("unchanged (these files are applied already)" if new is None else
               f"applied: policy set version {new.version}, {len(new.policies)} policies")


@policies_app.command()
def show(db: DbOpt = None, config: ConfigOpt = None,
         version: Annotated[int | None, typer.Option(help="a past version (default: the current one)")] = None) -> None:
    """Print the policy set in force (or a past version) as a policy file."""
    import yaml

    from router.store.policies import PolicyStore

    store = PolicyStore(_store_target(db, config))
    try:
        ps = store.at(version)
    finally:
        store.close()
    # a policy file as written (the store's version as a comment): `xroute policies apply` takes it back
    typer.echo(f"# policy set version {ps.version}")
    typer.echo(yaml.safe_dump(ps.model_dump(mode="json", exclude_none=True, exclude={"version"}), sort_keys=False),
               nl=False)


@policies_app.command()
def audit(db: DbOpt = None, config: ConfigOpt = None,
          resource: Annotated[str | None, typer.Option(help="only this resource (a policy's name)")] = None,
          limit: Annotated[int, typer.Option(help="most entries")] = 50) -> None:
    """The audit log, newest last: when, who, what, and the version it made."""
    from router.store.policies import PolicyStore

    store = PolicyStore(_store_target(db, config))
    try:
        entries = store.audit(resource=resource, limit=limit)
    finally:
        store.close()
    for e in entries:
        typer.echo(f"{e['audit_id']:>6}  {e['at']}  v{e['version']:<4} {e['principal']:<24} {e['action']:<7} "
                   f"{e['kind']}:{e['resource']}")


@policies_app.command(name="export-rego")
def export_rego(out: Annotated[Path, typer.Option(help="directory to write policy.rego and data.json into")],
                policies: PoliciesOpt = None, db: DbOpt = None, config: ConfigOpt = None) -> None:
    """Write the policies as Rego plus data (an OPA bundle's layout) so a cluster can enforce the
    same rules: query data.xroute.routing.decision (docs/policies.md, "Rego")."""
    from xroute.config import load_policies
    from xroute.policy_rego import write_rego

    if policies:
        ps = load_policies(*policies)
    else:
        from router.store.policies import PolicyStore

        store = PolicyStore(_store_target(db, config))
        try:
            ps = store.at()
        finally:
            store.close()
    files = write_rego(ps, out)
    typer.echo(f"wrote {', '.join(map(str, files))} ({len(ps.policies)} policies, version {ps.version})")
