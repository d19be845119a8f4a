"""``xroute export-feedback``: decisions and their observed outcomes as a telemetry bundle.

The bundle is the telemetry the decisions were made on (its tables copied unchanged) with the
``workload`` table replaced by the routed requests: one row per decision, at the telemetry time
the router used, ``request_id`` = the decision id, ``output_tokens`` = the observed count when
feedback gave one, else the requested maximum. An extra ``outcomes.csv`` (ignored by the loader)
holds what the router chose and expected, and what was observed. The result is validated with
:func:`xroute.bundle.load_bundle`, so ``xroute evaluate``/training read it like any bundle.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import psycopg

from router.logs import iso
from router.store import iter_decisions
from router.store_pg import is_postgres_url, one_line, redact
from xroute.bundle import DEFAULT_BUNDLE, load_bundle
from xroute.errors import ConfigError
from xroute.schema.telemetry import TABLE_SUFFIXES, TABLES, WORKLOAD


def export_bundle(db: Path | str, telemetry: Path | None, output: Path, tenant: str | None = None,
                  overwrite: bool = False) -> dict[str, Any]:
    """Write the bundle from the decision log ``db`` (a SQLite file or a ``postgresql://`` URL);
    returns counts (decisions exported, skipped for another bundle, with feedback)."""
    if is_postgres_url(db):
        where = redact(str(db))
    else:
        db = Path(db)
        where = str(db)
        if not db.is_file():
            raise ConfigError(f"--db: decision log '{db}' not found")
    src = Path(telemetry) if telemetry is not None else DEFAULT_BUNDLE
    bundle = load_bundle(src)
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise ConfigError(f"--output: '{output}' exists and is not empty; pass --overwrite or another path")
        shutil.rmtree(output)
    rows, skipped = [], 0
    try:
        decisions = list(iter_decisions(db, tenant))
    except psycopg.Error as e:
        raise ConfigError(f"--db: cannot read the decision log {where} ({one_line(e)})") from None
    for d in decisions:
        if d["bundle_hash"] != bundle.content_hash:
            skipped += 1
            continue
        rows.append(d)
    if not rows:
        raise ConfigError(f"no decisions in {where} were made on the bundle {src} (hash {bundle.content_hash})"
                          + (f"; {skipped} were made on other bundles" if skipped else ""))
    output.mkdir(parents=True, exist_ok=True)
    for name in TABLES:
        if name == WORKLOAD.name:
            continue
        for suffix in TABLE_SUFFIXES:
            f = src / f"{name}{suffix}"
            if f.is_file():
                shutil.copy2(f, output / f.name)
    df = pd.DataFrame(rows)
    out_tok = df["observed_output_tokens"].where(df["observed_output_tokens"].notna(), df["max_output_tokens"])
    workload = pd.DataFrame({
        "ts": [iso(t) for t in df["telemetry_ts"]],
        "request_id": df["decision_id"],
        "origin": df["origin"],
        "input_tokens": df["input_tokens"].astype(int),
        "max_output_tokens": df["max_output_tokens"].astype(int),
        "ttft_ms": df["ttft_ms"],
        "tpot_ms": df["tpot_ms"],
        "deadline_ms": df["deadline_ms"],
        "model": df["model"],
        "output_tokens": out_tok.astype(int),
        "session_id": df["session_id"].fillna(""),
        "tenant": df["tenant"],
        "_t": df["telemetry_ts"],
    }).sort_values(["_t", "request_id"], kind="stable").drop(columns="_t")
    workload.to_csv(output / "workload.csv", index=False)
    outcomes = df[["decision_id", "tenant", "offering_id", "policy", "policy_kind", "policy_version",
                   "expected_latency_ms", "expected_cost_usd", "observed_latency_ms", "observed_cost_usd",
                   "observed_output_tokens", "failed", "error"]].copy()
    outcomes.insert(1, "created_at", [iso(t) for t in df["created_at"]])
    outcomes["feedback_at"] = [iso(t) if pd.notna(t) else "" for t in df["feedback_at"]]
    outcomes.to_csv(output / "outcomes.csv", index=False)
    (output / "README.md").write_text(
        f"# Routed requests exported by `xroute export-feedback`\n\nDecisions from `{where}` on the bundle "
        f"`{src}` (hash {bundle.content_hash}); every table but `workload` is copied from it. `workload` holds "
        "one row per decision at the telemetry time the router used (`request_id` = decision id); "
        "`outcomes.csv` holds the chosen offering, the expectations and the observed feedback.\n")
    load_bundle(output)  # the export must be a valid bundle
    return {"decisions": len(rows), "skipped_other_bundle": skipped,
            "with_feedback": int(df["feedback_at"].notna().sum()), "output": str(output)}
