"""``xroute export-feedback``: decisions and their observed outcomes as a telemetry bundle; ``xroute
export-ope``: the decisions with feedback as the logged decisions ``xroute ope`` reads.

``export-feedback``:

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

from router.core.logs import iso
from router.core.text import one_line, redact
from router.store.dialect import is_postgres_url
from router.store.readers import iter_decisions
from xroute.bundle import DEFAULT_BUNDLE, load_bundle
from xroute.errors import ConfigError
from xroute.schema.telemetry import TABLE_SUFFIXES, TABLES, WORKLOAD


def _log(db: Path | str) -> tuple[Path | str, str]:
    """The decision log ``db`` (a SQLite file, which must exist, or a ``postgresql://`` URL) and
    how to name it (a URL redacted)."""
    if is_postgres_url(db):
        return db, redact(str(db))
    if not Path(db).is_file():
        raise ConfigError(f"--db: decision log '{db}' not found")
    return Path(db), str(db)


def export_bundle(db: Path | str, telemetry: Path | None, output: Path, tenant: str | None = None,
                  overwrite: bool = False) -> dict[str, Any]:
    """Write the bundle from the decision log ``db`` (a SQLite file or a ``postgresql://`` URL);
    returns counts (decisions exported, skipped for another bundle, with feedback)."""
    db, where = _log(db)
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


#: why ``export_ope`` leaves a decision out, in the order it checks, with how its line says it
OPE_SKIPS = {
    "pending": "without feedback yet",
    "no_features": "logged without features (before this version, or log_features: false)",
    "moved": "moved by the shared state off the offering drawn (that pool had no room: propensity unknown)",
    "no_reward": "whose feedback says too little to score (a completed request needs latency_ms, ttft_ms and "
                 "output_tokens)",
    "other_layout": "logged with another feature layout or an unknown catalog",
}


def export_ope(db: Path | str, output: Path, env_cfg: Any, tenant: str | None = None, since: float | None = None,
               until: float | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write the decisions of the log ``db`` (a SQLite file or a ``postgresql://`` URL) that have
    feedback with a reward as an off-policy-evaluation log (``xroute.schema.ope.write_log``; the
    encoding follows ``output``'s suffix): per decision the action set, the features its policy saw,
    the served offering, its propensity, the policy, the exploration probability, the reward and
    the raw feedback (its latest). ``since``/``until``: wall-time bounds on when the decisions were
    made; ``env_cfg``: the router's environment config, whose reward the header names. Returns the
    count exported and the counts left out, by reason (:data:`OPE_SKIPS`)."""
    from envs.features import OFFERING_FEATURES, REQUEST_FEATURES
    from models.ope import reward_weights
    from router.decision import ope_log
    from router.store.sqlite import read_catalogs
    from xroute.schema.ope import SUFFIXES, Feedback, LoggedDecision, LogHeader, write_log

    output = Path(output)
    if not output.name.endswith(SUFFIXES):
        raise ConfigError(f"--output: '{output}': a decision log is named *.parquet, *.jsonl or *.jsonl.gz")
    if output.exists() and not overwrite:
        raise ConfigError(f"--output: '{output}' exists; pass --overwrite or another path")
    db, where = _log(db)
    skipped = dict.fromkeys(OPE_SKIPS, 0)
    records: list[LoggedDecision] = []
    try:
        catalogs = read_catalogs(db)
        for d in iter_decisions(db, tenant, since, until, ope=True):
            ids: list[str] | None = None
            why = ("pending" if d["feedback_at"] is None else "no_features" if d["features"] is None
                   else "moved" if d["propensity"] is None else "no_reward" if d["reward"] is None else None)
            if why is None:
                rec = ope_log.unpack(d["features"])
                ids = catalogs.get(rec.catalog_key)
                if ids is None or rec.rows.shape[1] != len(OFFERING_FEATURES) or \
                        rec.request.shape[0] != len(REQUEST_FEATURES):
                    why = "other_layout"
            if why is not None or ids is None:
                skipped[why or "other_layout"] += 1
                continue
            records.append(LoggedDecision(
                decision_id=d["decision_id"], tenant=d["tenant"], ts=iso(d["created_at"]),
                action_set=[ids[i] for i in rec.action_idx.tolist()], offering_features=rec.rows.tolist(),
                request_features=rec.request.tolist(), chosen=rec.chosen, propensity=d["propensity"],
                policy=d["policy"], policy_version=d["policy_version"], epsilon=d["epsilon"], reward=d["reward"],
                feedback=Feedback(cost_usd=d["observed_cost_usd"], latency_ms=d["observed_latency_ms"],
                                  ttft_ms=d["observed_ttft_ms"], output_tokens=d["observed_output_tokens"],
                                  sla_violation=None if d["sla_violation"] is None else bool(d["sla_violation"]),
                                  failed=bool(d["failed"]), error=d["error"])))
    except psycopg.Error as e:
        raise ConfigError(f"--db: cannot read the decision log {where} ({one_line(e)})") from None
    left_out = ", ".join(f"{n} {OPE_SKIPS[k]}" for k, n in skipped.items() if n) or "none"
    if not records:
        raise ConfigError(f"no decision in {where} has feedback with a reward to export; left out: {left_out}")
    header = LogHeader(offering_features=list(OFFERING_FEATURES), request_features=list(REQUEST_FEATURES),
                       reward=reward_weights(env_cfg), source=f"router {where}")
    write_log(output, header, records)
    return {"decisions": len(records), "skipped": skipped, "left_out": left_out, "output": str(output)}
