"""The model page's registry view: for a ``models:/<name>@<alias>`` URI, the champion and challenger
versions of ``<name>`` in the MLflow registry, each with its run, the promotion gate's verdict and
figures (the version's ``gate_*`` tags and the run's ``gate_*`` metrics, ``models.tracking.log_gate``)
and a link to the run in the MLflow UI. Read through MLflow's public client, at most once per
:data:`TTL_S` per URI (a blocking call: the page runs it in a thread)."""

from __future__ import annotations

import threading
import time
from typing import Any

#: seconds a registry view is reused
TTL_S = 30.0
_cache: dict[str, tuple[float, dict[str, Any]]] = {}
_lock = threading.Lock()
ALIASES = ("champion", "challenger")


def registry_view(model_uri: str | None) -> dict[str, Any]:
    """``{"name", "versions": [{alias, version, run_id, run_link, gate_passed, gate_reason, tags, metrics}],
    "error"}``; ``name`` None for a URI that is no registered model (a path, ``runs:/``, none)."""
    if not model_uri or not model_uri.startswith("models:/"):
        return {"name": None, "versions": [], "error": None}
    now = time.monotonic()
    with _lock:
        hit = _cache.get(model_uri)
        if hit is not None and now - hit[0] < TTL_S:
            return hit[1]
    view = _read(model_uri)
    with _lock:
        _cache[model_uri] = (now, view)
    return view


def _read(model_uri: str) -> dict[str, Any]:
    name = model_uri[len("models:/"):].split("@", 1)[0].split("/", 1)[0]
    out: dict[str, Any] = {"name": name, "versions": [], "error": None}
    try:
        import mlflow
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient()
        tracking = mlflow.get_tracking_uri()
        for alias in ALIASES:
            try:
                mv = client.get_model_version_by_alias(name, alias)
            except MlflowException:
                out["versions"].append({"alias": alias, "version": None})
                continue
            tags = dict(mv.tags or {})
            metrics: dict[str, float] = {}
            link = None
            if mv.run_id:
                try:
                    run = client.get_run(mv.run_id)
                    metrics = {k: v for k, v in sorted(run.data.metrics.items()) if k.startswith("gate_")
                               or k.startswith("warm_start_gate_")}
                    if tracking.startswith(("http://", "https://")):
                        link = f"{tracking.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{mv.run_id}"
                except MlflowException:
                    pass
            out["versions"].append({"alias": alias, "version": mv.version, "run_id": mv.run_id, "run_link": link,
                                    "gate_passed": tags.get("gate_passed"), "gate_reason": tags.get("gate_reason"),
                                    "tags": {k: v for k, v in sorted(tags.items()) if k.startswith("gate_")},
                                    "metrics": metrics})
        out["tracking_uri"] = tracking
    except Exception as e:  # (the registry unreachable, a store it cannot open: the page says so)
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    return out
