"""Logging and registering the learned router in MLflow, and promotion: where a training run's
experiment lives, the pyfunc model (``models.pyfunc``) logged with the code and requirements it
needs, a new registered version with the ``challenger`` alias, and ``xroute promote`` moving
``champion``. Fetching a model back (URIs, the default store) is
``models.loader``.

Imports neither torch nor stable-baselines3.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from models.loader import quiet_mlflow
from models.ope import promotion_check
from models.policy import read_router
from models.pyfunc import ARTIFACT_KEY, MODEL_CODE, pip_requirements, predict_frame, signature, stage_code

CHALLENGER = "challenger"
CHAMPION = "champion"


def artifact_root(run_dir: str | Path) -> str:
    return (Path(run_dir).resolve() / "mlartifacts").as_uri()


def setup(uri: str, experiment: str, run_dir: str | Path) -> str:
    """Point MLflow at ``uri`` and return the id of ``experiment`` (created with its artifacts
    under ``run_dir/mlartifacts`` when the store is the local default)."""
    quiet_mlflow()
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is not None:
        return str(exp.experiment_id)
    location = artifact_root(run_dir) if uri.startswith(("sqlite:", "file:")) or "://" not in uri else None
    try:
        return str(mlflow.create_experiment(experiment, artifact_location=location))
    except Exception:  # another process created it first
        exp = mlflow.get_experiment_by_name(experiment)
        if exp is None:
            raise
        return str(exp.experiment_id)


def log_router_model(router_dir: str | Path, input_example: Any, name: str = "router") -> Any:
    """Log an exported router as a pyfunc model in the active run; returns MLflow's ModelInfo.

    The model carries its inference code (``models.pyfunc.stage_code``), is built from code at load
    (``models.pyfunc.MODEL_CODE``, nothing pickled) and lists what that code needs
    (``models.pyfunc.pip_requirements``), with its signature and ``input_example`` (which must score
    here, with the export, before anything is logged): it loads with ``mlflow.pyfunc.load_model``
    where xroute is not installed."""
    predict_frame(read_router(router_dir), input_example)
    with tempfile.TemporaryDirectory(prefix="xroute-code-") as staging:
        return mlflow.pyfunc.log_model(name=name, python_model=str(MODEL_CODE), artifacts={ARTIFACT_KEY: str(router_dir)},
                                       code_paths=stage_code(staging), signature=signature(),
                                       input_example=input_example, pip_requirements=pip_requirements())


def register(model_uri: str, registered_model: str, alias: str = CHALLENGER,
             tags: dict[str, Any] | None = None) -> str:
    """Register ``model_uri`` as a new version of ``registered_model``, tag it and point ``alias``
    at it. Returns the version."""
    with contextlib.redirect_stderr(io.StringIO()):  # its "Successfully registered"/"Created version" prints
        mv = mlflow.register_model(model_uri, registered_model)
    client = MlflowClient()
    for k, v in (tags or {}).items():
        client.set_model_version_tag(registered_model, mv.version, k, str(v))
    client.set_registered_model_alias(registered_model, alias, mv.version)
    return str(mv.version)


def _alias_version(client: Any, name: str, alias: str) -> Any | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


@dataclass
class PromoteDecision:
    promoted: bool
    reason: str
    version: str | None = None


def promote(registered_model: str, ope: dict[str, Any] | None = None, ope_estimator: str = "dr",
            ope_source: str = "the OPE report") -> PromoteDecision:
    """Move ``champion`` to the ``challenger`` version if it passed the gate at training time
    (``models.gate``: on test windows no selection saw, the lower bound of its paired difference
    in mean reward to the best baseline is above zero, and it loses significantly nowhere; the
    verdict is recorded as version tags). With ``ope`` (an ``xroute ope`` report) it must also
    pass ``models.ope.promotion_check`` on the logged traffic. Never raises for a refusal."""
    client = MlflowClient()
    ch = _alias_version(client, registered_model, CHALLENGER)
    if ch is None:
        return PromoteDecision(False, f"model '{registered_model}' has no '{CHALLENGER}' version; run xroute train first")
    tags = ch.tags or {}
    if "gate_passed" not in tags:
        return PromoteDecision(False, f"{registered_model} v{ch.version} carries no gate verdict (tags gate_*): it was "
                                      "trained before the promotion gate existed; retrain it (xroute train)", ch.version)
    champ = _alias_version(client, registered_model, CHAMPION)
    if champ is not None and str(champ.version) == str(ch.version):
        return PromoteDecision(False, f"v{ch.version} is already the champion", ch.version)
    if str(tags["gate_passed"]).lower() != "true":
        return PromoteDecision(False, f"challenger v{ch.version} did not pass the gate: {tags.get('gate_reason', '')}",
                               ch.version)
    ope_why = ""
    if ope is not None:
        ok, why = promotion_check(ope, registered_model, str(ch.version), None if champ is None else str(champ.version),
                                  ope_estimator, ope_source)
        if not ok:
            return PromoteDecision(False, f"challenger v{ch.version} passed the gate but not the OPE check: {why}",
                                   ch.version)
        ope_why = f"; {why}"
    client.set_registered_model_alias(registered_model, CHAMPION, ch.version)
    was = f" (was v{champ.version})" if champ is not None else ""
    return PromoteDecision(True, f"champion -> v{ch.version}{was}: {tags.get('gate_reason', '')}{ope_why}", ch.version)

