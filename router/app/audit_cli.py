"""``xroute audit export``: the audit log (``router.store.audit``) as JSON lines for a SIEM, one
entry per line, oldest first, each with its trace id (docs/observability.md).

Imports stay inside the functions: ``xroute --help`` must not pay for the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

audit_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                        help="The audit log: export it as JSON lines (docs/observability.md).")


@audit_app.command()
def export(
    db: Annotated[str | None, typer.Option(help="the router's decision log, where its audit log lives: a SQLite file "
                                                "or a postgresql:// URL (default: the router config's db_url, else "
                                                "db_path)")] = None,
    config: Annotated[Path | None, typer.Option(help="router config YAML")] = None,
    since: Annotated[str | None, typer.Option(help="only entries at or after this time (ISO-8601, UTC unless it "
                                               "says)")] = None,
    until: Annotated[str | None, typer.Option(help="only entries before this time")] = None,
    output: Annotated[Path | None, typer.Option(help="write here (default: standard output)")] = None,
) -> None:
    """Every audit entry (when, who, what changed, before and after, the request and trace ids) as
    one JSON object per line, oldest first: `xroute audit export --since 2026-01-01 > audit.jsonl`."""
    from router.app.cli import _wall_time
    from router.core.settings import load_settings
    from router.store import audit
    from router.store.dialect import stream

    target: Path | str = db if db is not None else load_settings(config).log_target
    sql, args = audit.export_sql(_wall_time("--since", since), _wall_time("--until", until))
    out = sys.stdout if output is None else output.open("w", encoding="utf-8")
    n = 0
    try:
        for row in stream(target, sql, args):
            out.write(json.dumps(audit.entry(row), separators=(",", ":")) + "\n")
            n += 1
        out.flush()
    finally:
        if output is not None:
            out.close()
    if output is not None:
        typer.echo(f"exported {n} audit entries to {output}", err=True)
