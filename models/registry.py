"""MLflow plumbing of the learned router: where the store is, logging and registering the model,
moving the ``challenger``/``champion`` aliases, and fetching a model for ``xroute evaluate``.

Default store (no server): tracking in ``sqlite:///<run_dir>/mlflow.db`` and artifacts under
``<run_dir>/mlartifacts``; ``$MLFLOW_TRACKING_URI`` overrides it. Open the UI with::

    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db --host 127.0.0.1

This module imports neither torch nor stable-baselines3.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xroute.errors import ConfigError, XrouteError

CHALLENGER = "challenger"
CHAMPION = "champion"
#: relative to the working directory (where `xroute train` put its store)
DEFAULT_RUN_DIR = Path("runs")
#: what the pyfunc needs at load time (explicit: inferring them costs seconds per log_model)
PIP_REQUIREMENTS_PACKAGES = ("mlflow", "numpy", "pandas", "gymnasium")


def _quiet() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


def tracking_uri(run_dir: str | Path | None = None, configured: str | None = None) -> str:
    """``$MLFLOW_TRACKING_URI``, else ``configured``, else the SQLite file under ``run_dir``."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if configured:
        return configured
    d = Path(run_dir) if run_dir is not None else DEFAULT_RUN_DIR
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d.resolve() / 'mlflow.db'}"


def artifact_root(run_dir: str | Path) -> str:
    return (Path(run_dir).resolve() / "mlartifacts").as_uri()


def setup(uri: str, experiment: str, run_dir: str | Path) -> str:
    """Point MLflow at ``uri`` and return the id of ``experiment`` (created with its artifacts
    under ``run_dir/mlartifacts`` when the store is the local default)."""
    _quiet()
    import mlflow

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


def pip_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{p}=={version(p)}" for p in PIP_REQUIREMENTS_PACKAGES]


def log_router_model(router_dir: str | Path, input_example: Any, name: str = "router") -> Any:
    """Log an exported router as a pyfunc model in the active run; returns MLflow's ModelInfo."""
    import mlflow
    from mlflow.models import infer_signature

    from models.policy import read_router
    from models.pyfunc import ARTIFACT_KEY, RouterModel, predict_frame

    output = predict_frame(read_router(router_dir), input_example)
    signature = infer_signature(input_example, output)
    return mlflow.pyfunc.log_model(name=name, python_model=RouterModel(), artifacts={ARTIFACT_KEY: str(router_dir)},
                                   signature=signature, input_example=input_example,
                                   pip_requirements=pip_requirements())


def register(model_uri: str, registered_model: str, alias: str = CHALLENGER,
             tags: dict[str, Any] | None = None) -> str:
    """Register ``model_uri`` as a new version of ``registered_model``, tag it and point ``alias``
    at it. Returns the version."""
    import mlflow
    from mlflow import MlflowClient

    mv = mlflow.register_model(model_uri, registered_model)
    client = MlflowClient()
    for k, v in (tags or {}).items():
        client.set_model_version_tag(registered_model, mv.version, k, str(v))
    client.set_registered_model_alias(registered_model, alias, mv.version)
    return str(mv.version)


def _alias_version(client: Any, name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException

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
    from mlflow import MlflowClient

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
        from models.ope import promotion_check

        ok, why = promotion_check(ope, registered_model, str(ch.version), None if champ is None else str(champ.version),
                                  ope_estimator, ope_source)
        if not ok:
            return PromoteDecision(False, f"challenger v{ch.version} passed the gate but not the OPE check: {why}",
                                   ch.version)
        ope_why = f"; {why}"
    client.set_registered_model_alias(registered_model, CHAMPION, ch.version)
    was = f" (was v{champ.version})" if champ is not None else ""
    return PromoteDecision(True, f"champion -> v{ch.version}{was}: {tags.get('gate_reason', '')}{ope_why}", ch.version)


def model_version(uri: str) -> dict[str, str] | None:
    """The registered model and version a ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` URI
    points at now (``None`` for another form, e.g. a stage); what an OPE report records so that
    ``promote --ope`` can tell which version it estimated."""
    _quiet()
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(tracking_uri())
    rest = uri.removeprefix("models:/")
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = str(MlflowClient().get_model_version_by_alias(name, alias).version)
        else:
            name, _, version = rest.rpartition("/")
            if not name or not version.isdigit():
                return None
            MlflowClient().get_model_version(name, version)
    except MlflowException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--policy: cannot resolve '{uri}' in {mlflow.get_tracking_uri()}: {first}") from None
    return {"registered_model": name, "version": version, "uri": uri}


def download_model(uri: str, dst: str | Path | None = None) -> Path:
    """Local copy of ``models:/…`` or ``runs:/…`` (default store unless ``$MLFLOW_TRACKING_URI``)."""
    _quiet()
    import mlflow
    from mlflow.exceptions import MlflowException

    mlflow.set_tracking_uri(tracking_uri())
    target = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="xroute-model-"))
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target)))
    except MlflowException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--policy: cannot load '{uri}' from {mlflow.get_tracking_uri()}: {first}") from None
    except OSError as e:
        raise XrouteError(f"--policy: cannot download '{uri}': {e}") from None
